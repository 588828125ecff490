"""scripts/stress.py's HTTP attacks, a second or so each, against the real scheduler (--check-pages:
a leaked page crashes it) and the tiny byte-level model of test_serving.py; and what they found,
one request each."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from scripts import stress
from scripts.stress_http import error_shaped
from scripts.stress_http_probes import PATHS, good, nested
from tests.test_serving import WAIT_S, model_dir, start, stop  # noqa: F401 (model_dir: a fixture)

ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # {"a": {"a": ...


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):  # noqa: F811
    s = start(tmp_path_factory.mktemp("srv"), model_dir, "--served-model-name", "tiny",
              "--http-max-body", str(1 << 20))
    url = s.proc.stdout.readline().split()[-1]
    yield s, url
    assert stop(s) == 0, s.log.read_text()[-3000:]


@pytest.mark.parametrize("path", PATHS)
def test_json_nested_too_deeply_is_a_400_in_the_apis_shape(server, path):
    """msgspec's depth limit raised RecursionError, answered as a 500 "internal error"."""
    reply = httpx.post(server[1] + path, content=nested(path, "tiny", 5_000), timeout=WAIT_S)
    assert reply.status_code == 400 and error_shaped(path, reply.json()), reply.text
    assert "nests too deeply" in reply.text


def test_http_attacks_get_their_apis_errors_and_leave_no_page_behind(server, capsys):
    s, url = server
    code = stress.main(["--endpoint", s.endpoint, "--http", url, "--http-only", "--duration", "6",
                        "--clients", "4"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err[-3000:]
    assert "leaked KV pages: 0" in out.out


@pytest.mark.parametrize("path, constraint", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "o", "schema": ENDLESS}}}),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "o", "schema": ENDLESS, "strict": True}}}),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": ENDLESS}], "tool_choice": {"type": "any"}}),
])
def test_a_schema_the_grammar_cannot_follow_is_a_400_not_a_500(server, path, constraint):
    """No finite value: llguidance's item limit stops the grammar at the first token, which the
    engine reported as its own failure (a 500, with the parser's state dumped into the message)."""
    reply = httpx.post(server[1] + path, json=good(path, "tiny", **constraint), timeout=WAIT_S)
    assert reply.status_code == 400 and error_shaped(path, reply.json()), reply.text
    assert "the grammar refused" in reply.text and "<state>" not in reply.text


def test_count_tokens_may_count_a_prompt_past_the_context():
    """A 20 MB prompt under the body limit is a 4xx for every API but count_tokens, which counts it."""
    import random

    from scripts.stress_http_probes import COUNT, OVER, huge_bodies

    probes = huge_bodies(random.Random(0), "m")
    seen = [next(probes) for _ in range(200)]
    under = [p for p in seen if isinstance(p.body, dict) and "tools" not in p.body]
    assert {p.path for p in under if not p.bad} == {COUNT} and any(p.bad for p in under)
    assert all(p.bad for p in seen if isinstance(p.body, bytes) and len(p.body) >= OVER)


def test_busy_loops_spin_while_the_block_runs_and_end_with_it():
    with stress.busy_loops(2) as loops:
        time.sleep(0.5)
        assert [p.poll() for p in loops] == [None, None]
        # utime, in clock ticks (field 14 of /proc/PID/stat): each has been running, not sleeping
        assert all(int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[11]) > 0 for p in loops)
    assert all(p.returncode is not None for p in loops)
