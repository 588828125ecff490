"""What is compiled or planned after warm-up is counted, logged by name, and reaches the stats."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from worker import compile_watch


@pytest.fixture
def watch(monkeypatch):
    fresh = compile_watch.CompileWatch()
    monkeypatch.setattr(compile_watch, "WATCH", fresh)
    return fresh


def triton_compiles(name: str) -> None:
    """Call the hook the way Triton's JIT does after it compiles a new specialisation."""
    from triton import knobs

    knobs.runtime.jit_post_compile_hook(key=("k",), repr=f"{name}[num_warps=4](n: i32)",
                                        fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                                        already_compiled=False)


def test_a_compilation_after_warm_up_is_counted_and_logged(watch, caplog):
    pytest.importorskip("triton")
    compile_watch.install()
    compile_watch.install()  # once: a second install does not chain the hook onto itself
    triton_compiles("warm_kernel")
    assert watch.stats()["compiles_total"] == 1 and watch.stats()["compiles_after_warmup"] == 0
    compile_watch.arm()
    with caplog.at_level(logging.WARNING, logger="sluice.worker"):
        triton_compiles("late_kernel")
    assert watch.stats()["compiles_after_warmup"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        "compiled after warm-up: Triton kernel late_kernel (late_kernel[num_warps=4](n: i32))"]


def test_a_new_plan_shape_after_warm_up_is_counted_once(watch, caplog):
    watch.note_plan("cuDNN attention", (2048, 32, 65536, False))
    compile_watch.arm()
    with caplog.at_level(logging.WARNING, logger="sluice.worker"):
        watch.note_plan("cuDNN attention", (2048, 32, 65536, False))  # seen in warm-up: no plan built
        watch.note_plan("cuDNN attention", (1999, 32, 67584, False))
        watch.note_plan("cuDNN attention", (1999, 32, 67584, False))
    assert watch.stats()["plans_after_warmup"] == 1 and watch.stats()["plans_total"] == 2
    assert len(caplog.records) == 1 and "(1999, 32, 67584, False)" in caplog.records[0].getMessage()


def test_warm_up_arms_the_watch_and_the_stats_carry_it(watch, tmp_path):
    from scheduler.engine import Engine, EngineConfig
    from scheduler.warmup import warm_up
    from tests.tiny_models import write_tiny
    from worker.runner import ModelRunner, RunnerConfig

    write_tiny(tmp_path, "mixtral")
    engine = Engine(ModelRunner(RunnerConfig(str(tmp_path), device="cpu", kv_tokens=512)), EngineConfig())
    assert not watch.armed
    warm_up(engine)
    assert watch.armed
    watch.on_compile("served_kernel")
    assert engine.stats()["compiles_after_warmup"] == 1
