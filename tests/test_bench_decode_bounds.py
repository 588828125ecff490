"""scripts/bench_decode.py: a resident row's HBM bound counts the distinct experts that the same
batch looked up behind a cache, or that the synthetic router's process gives, not ``min(E, batch * k)``;
the clock sees every decode step it counts."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # bench_decode imports report_table
import bench_decode  # noqa: E402
import kernel_profile  # noqa: E402
from bench_decode import HBM_BYTES_PER_S, resident_bounds_from_lookups  # noqa: E402

EXPERT, DENSE, LAYERS = 9_437_184, 2.46e9, 48


def row(fraction, batch, per_layer, tok_s, prefetch="off", experts="bf16"):
    step = (DENSE + per_layer * LAYERS * EXPERT) / HBM_BYTES_PER_S
    return dict(gpus=1, fraction=fraction, experts=experts, prefetch=prefetch, batch=batch, tok_s=tok_s,
                experts_per_layer=per_layer, distinct="assumed" if fraction >= 1 else "looked up",
                dense_bytes=DENSE, sequence_bytes=0, expert_bytes=EXPERT, layers=LAYERS, step_pcie=0.0,
                bound_tok_s=batch / step, ratio=tok_s * step / batch)


def test_a_resident_row_takes_the_distinct_experts_its_batch_looked_up():
    resident = row(1.0, 8, 64, 1077.6)  # min(128, 8 * 8) assumed
    cached = row(0.25, 8, 37.8, 44.5)
    guessing = row(0.25, 8, 60.0, 39.4, prefetch="on")  # prefetch's ahead lookups are not the routing
    other = row(1.0, 32, 128, 2733.7)  # no cached row of batch 32: keeps the assumption
    assumed = resident["ratio"]
    resident_bounds_from_lookups([resident, cached, guessing, other])
    assert resident["distinct"] == "from cache" and resident["experts_per_layer"] == 37.8
    step = (DENSE + 37.8 * LAYERS * EXPERT) / HBM_BYTES_PER_S
    assert resident["bound_tok_s"] == pytest.approx(8 / step)
    assert resident["ratio"] == pytest.approx(1077.6 * step / 8) and resident["ratio"] < assumed
    assert other["distinct"] == "assumed" and other["experts_per_layer"] == 128
    assert cached["distinct"] == "looked up" and cached["experts_per_layer"] == 37.8


@pytest.mark.parametrize("sampling", [bench_decode.SamplingParams(), bench_decode.SAMPLED], ids=["greedy", "sampled"])
def test_the_clock_sees_every_decode_step_it_counts(tmp_path, monkeypatch, sampling):
    """decode_run counts ``decode_tokens - 1`` decode steps of tokens; the timed window must launch
    all of them (waiting for the first token before the clock launched decode step 1 early). Every
    request samples as asked (``--sampling``)."""
    from scheduler.request import Request
    from tests.tiny_models import write_tiny
    from worker.runner import ModelRunner, RunnerConfig

    write_tiny(tmp_path, "qwen3_moe", layers=1, experts=4, top_k=2)
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cpu", page_size=4, kv_tokens=256))
    launch, timed = runner.launch, bench_decode.timed_steps  # the engine launches, then samples
    launched = []

    def counting_launch(chunks, *args, **kwargs):
        launched.append(len(chunks))
        return launch(chunks, *args, **kwargs)

    def counting_timed_steps(*args):
        launched.clear()  # the prefill ran before the clock
        return timed(*args)

    monkeypatch.setattr(runner, "launch", counting_launch)
    monkeypatch.setattr(bench_decode, "timed_steps", counting_timed_steps)
    requests = []
    monkeypatch.setattr(bench_decode, "Request", lambda *a, **k: requests.append(Request(*a, **k)) or requests[-1])
    r = bench_decode.decode_run(runner, batch=2, prompt_tokens=5, decode_tokens=6, seed=0, sampling=sampling)
    assert r["steps"] == 5 and r["tokens"] == 10
    assert launched == [2] * 5  # five decode steps of both requests inside the window
    assert [req.sampling for req in requests] == [sampling] * 2


def test_a_resident_row_under_synthetic_routing_models_its_distinct_experts():
    from moe_offload.synthetic_routing import synthetic_trace

    class Config:
        num_layers, num_experts, top_k = 3, 32, 4

    ids = synthetic_trace(3, 32, 4, sequences=5, tokens=7)  # [L, N, T, k]
    by_hand = sum(len(set(ids[l, :, t].flatten().tolist())) for l in range(3) for t in range(7)) / 21
    assert bench_decode.synthetic_distinct(Config, 5, 7) == pytest.approx(by_hand)
    assert bench_decode.synthetic_distinct(Config, 1, 7) == 4  # one token's k choices are distinct


def test_busy_time_is_the_union_of_kernel_intervals():
    """Kernels that overlap (two streams, or PDL's early launch) count once; gaps not at all."""
    assert kernel_profile.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert kernel_profile.busy_us([(3, 4)]) == 1 and kernel_profile.busy_us([]) == 0


def test_each_kernel_adds_the_busy_time_past_the_kernels_before_it():
    """Under PDL a kernel starts while the one before runs and waits for it: it adds only what runs
    past that one's end; one inside another's interval adds nothing; the parts sum to the union."""
    spans = [("b", 5, 12), ("a", 0, 10), ("c", 20, 25), ("d", 21, 22), ("e", 24, 30)]
    added = kernel_profile.added_us(spans)
    assert added == [2, 10, 5, 0, 5]  # kept in the spans' order, counted in start order
    assert sum(added) == kernel_profile.busy_us([span[1:] for span in spans])
    ranked = kernel_profile.top_kernels(spans + [("a", 40, 41)], top=2, per=2)
    assert ranked == [["a", 1.0, 5.5, 5.5], ["c", 0.5, 2.5, 2.5]]  # by the time added: a 11, c 5, e 5, b 2


def test_a_prompt_longer_than_the_plans_chunk_is_prefilled_in_chunks(tmp_path, monkeypatch):
    """``--prompt-tokens 131072`` must not become one chunk past the activations the memory plan
    reserved: a long prompt takes the plan's chunks, short ones keep one chunk for the batch."""
    from tests.tiny_models import write_tiny
    from worker.runner import ModelRunner, RunnerConfig

    write_tiny(tmp_path, "qwen3_moe", layers=1, experts=4, top_k=2)
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cpu", page_size=4, kv_tokens=1024, max_prefill_tokens=64))
    launch, chunks = runner.launch, []
    monkeypatch.setattr(runner, "launch", lambda c, *a, **k: chunks.append(sum(len(x.token_ids) for x in c))
                        or launch(c, *a, **k))
    bench_decode.decode_run(runner, batch=1, prompt_tokens=150, decode_tokens=2, seed=0)
    assert chunks[:3] == [64, 64, 22]  # then the decode steps
    chunks.clear()
    bench_decode.decode_run(runner, batch=2, prompt_tokens=20, decode_tokens=2, seed=0)
    assert chunks[0] == 40  # both prompts in one chunk


def test_the_expert_kernels_are_the_routed_experts_gemms_and_the_gather_of_misses_only():
    """The GEMMs of every format's prefill and decode paths and the gather of misses (bytes the PCIe
    bound counts) are expert kernels; the dense GEMV, attention, norms, the router's top-k and the
    cache's lookup are not."""
    experts = bench_decode.expert_gemm_kernels()
    assert {"_decode_gate_up_pair_kernel", "_gate_up_pair_w4_kernel", "_down_token_w4_kernel",
            "_sum_k_kernel", "gather_missing_kernel", "gather_missing_few_kernel"} <= experts
    assert not {"gemv_kernel", "decode_partial_kernel", "add_rms_norm_kernel", "lookup_admit_kernel"} & experts


def test_non_expert_time_is_the_union_of_the_other_kernels():
    spans = [("gemv_kernel", 0, 10), ("_decode_gate_up_pair_kernel", 10, 30), ("add_rms_norm_kernel", 28, 35),
             ("decode_partial_kernel", 40, 42)]
    assert bench_decode.non_expert_us(spans) == 10 + 7 + 2


def test_an_offloaded_row_without_guesses_gets_the_ceiling_of_its_own_non_expert_work():
    """ceiling = misses' PCIe time / (that + the step's non-expert work); a resident row, or a row
    with guesses (they use the link during that work), gets nan."""
    def r(fraction, prefetch="off", step_pcie=0.0, non_expert_ms=0.0):
        return dict(fraction=fraction, prefetch=prefetch, step_pcie=step_pcie, non_expert_ms=non_expert_ms,
                    dense_bytes=2.25e9, shared_bytes=0.25e9, sequence_bytes=0.15e9, batch=1, decode_tok_s=100.0)

    resident, offloaded = r(1.0, non_expert_ms=1.29), r(0.25, step_pcie=5.29e-3, non_expert_ms=1.41)
    guessing = r(0.25, prefetch="on", step_pcie=6e-3, non_expert_ms=1.4)
    bench_decode.decode_ceilings([resident, offloaded, guessing])
    assert offloaded["ceiling"] == pytest.approx(5.29 / (5.29 + 1.41))
    # at peak: the 2.15 GB of dense weights (the shared expert's left out) and KV at 4.3 TB/s, 0.5 ms
    assert offloaded["peak_ceiling"] == pytest.approx(5.29 / (5.29 + 0.5))
    # the misses' 290.95 MB (5.29 ms at 55 GB/s) over the timed 10 ms step less its 1.41 ms of non-expert work
    assert offloaded["miss_gbps"] == pytest.approx(5.29e-3 * 55e9 / 8.59e-3 / 1e9)
    assert all(math.isnan(x[key]) for x in (resident, guessing) for key in ("ceiling", "peak_ceiling", "miss_gbps"))


def test_a_row_is_the_run_of_the_median_rate_and_its_spread_spans_all_runs():
    seconds = [0.5, 0.25, 1.0, 0.4, 0.2]  # 200, 400, 100, 250 and 500 tok/s
    runs = [dict(tokens=100, seconds=s, hits=i) for i, s in enumerate(seconds)]
    chosen, spread = bench_decode.median_run(runs)
    assert chosen["hits"] == 3  # 250 tok/s, the middle of five
    assert spread == pytest.approx((500 - 100) / 250)
    chosen, spread = bench_decode.median_run(runs[:2])  # an even count takes the upper middle
    assert chosen["hits"] == 1 and spread == pytest.approx((400 - 200) / 400)
    assert bench_decode.median_run(runs[:1]) == (runs[0], 0.0)


def test_rows_repeat_five_times_but_over_long_prompts_once_unless_asked():
    from types import SimpleNamespace

    assert bench_decode.repeats_for(SimpleNamespace(repeats=0), 64) == 5
    assert bench_decode.repeats_for(SimpleNamespace(repeats=0), bench_decode.LONG_PROMPT) == 1  # a prefill a run
    assert bench_decode.repeats_for(SimpleNamespace(repeats=3), 131072) == 3


def test_a_benchmarks_header_names_the_timing_switches_set_and_no_other_variable(monkeypatch):
    """``report_table.switches``: what bench_decode, bench_prefill and bench_grouped_gemm_w4 add to their
    header line, so a result timed under SLUICE_W4_BF16_PAIRS=1 (say) says so."""
    import report_table

    for name in report_table.TIMING_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLUICE_PY", "/usr/bin/python3")  # not a switch
    assert report_table.switches() == ""
    monkeypatch.setenv("SLUICE_W4_BF16_PAIRS", "1")
    monkeypatch.setenv("SLUICE_W4_DECODE_TILES", "down_regs=0")
    assert report_table.switches() == ", switches SLUICE_W4_DECODE_TILES=down_regs=0 SLUICE_W4_BF16_PAIRS=1"
