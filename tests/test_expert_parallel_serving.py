"""The serving path with ``--gpus 2`` on CPU (frontend, scheduler = rank 0, one gloo rank process):
greedy completions equal a one-rank server's, a killed rank ends the server with one clear error
and no rank process left, and the stats and /metrics show each rank's expert counters."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.client import Client
from tests.test_expert_parallel import _gone
from tests.test_serving import PROMPTS, WAIT_S, greedy, model_dir, start, stop  # noqa: F401 (fixture)


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc, no psutil)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            kids.append(int(stat.parent.name))
    return kids


def _ranks(scheduler_pid: int) -> list[int]:
    """The scheduler's rank processes (spawn also starts a resource tracker, which is no rank)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ranks = [p for p in _children(scheduler_pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        if ranks:
            return ranks
        time.sleep(0.1)
    raise AssertionError(f"no rank process under the scheduler {scheduler_pid}")


@pytest.mark.slow
def test_two_rank_server_equals_one_and_a_killed_rank_ends_it(model_dir, tmp_path):  # noqa: F811
    prompts = PROMPTS[:6]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = start(tmp_path / "one", model_dir)
    try:
        with Client(one.endpoint, timeout=WAIT_S) as c:
            want = [greedy(c, p).token_ids for p in prompts]
    finally:
        assert stop(one) == 0
    two = start(tmp_path / "two", model_dir, "--gpus", "2")
    with Client(two.endpoint, timeout=WAIT_S) as c:
        assert [greedy(c, p).token_ids for p in prompts] == want
        ranks = _ranks(two.scheduler_pid)
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises(Exception):
            greedy(c, "after the rank died", max_tokens=50)
    assert two.proc.wait(timeout=WAIT_S) != 0
    log = two.log.read_text()
    assert f"error: rank 1 (pid {ranks[0]}) was killed by SIGKILL" in log, log[-3000:]
    assert _gone(two.scheduler_pid) and all(_gone(p) for p in ranks)


@pytest.mark.slow
def test_stats_and_metrics_show_each_rank(model_dir, tmp_path):  # noqa: F811
    server = start(tmp_path, model_dir, "--gpus", "2", "--moe-cache-size", "10")
    url = server.proc.stdout.readline().split()[-1]
    try:
        with Client(server.endpoint, timeout=WAIT_S) as c:
            for prompt in PROMPTS[:3]:
                greedy(c, prompt)
            stats = c.stats()
            text = httpx.get(url + "/metrics").text
    finally:
        assert stop(server) == 0, server.log.read_text()[-3000:]
    assert stats["ranks"] == 2
    assert all(stats[f"rank{r}.moe_lookups"] > 0 and f"rank{r}.moe_hit_rate" in stats for r in (0, 1))
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    for r in ("0", "1"):
        assert series[("sluice_rank_expert_cache_hit_rate", (("rank", r),))] == stats[f"rank{r}.moe_hit_rate"]
        assert series[("sluice_rank_pcie_bytes_total", (("kind", "expert_miss_h2d"), ("rank", r)))] == \
            stats[f"rank{r}.moe_bytes_h2d"]
    assert series[("sluice_expert_cache_hit_rate", ())] == stats["moe_hit_rate"]  # the total, as before
