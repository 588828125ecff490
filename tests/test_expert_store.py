from __future__ import annotations

import errno
import importlib.util
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_offload.expert_store import SHM_DIR, ExpertStore, list_segments
from moe_offload.progress import ProgressBar
from moe_offload.expert_names import FUSED_NAMES, MIXTRAL_NAMES, QWEN3_MOE_NAMES, ExpertNames
from moe_offload.store_fill import (
    fill_dummy,
    fill_from_safetensors,
    open_checkpoint_experts,
)
from moe_offload.safetensors_file import checkpoint_files
from moe_offload.store_header import COMPLETE_OFFSET, parse_header
from moe_offload.expert_records import RECORD_ALIGN, records_of
from moe_offload.store_layout import (
    ALIGN,
    BankLayout,
    ExpertGeometry,
    StoreIdentity,
)

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = ExpertGeometry(num_layers=2, num_experts=4, hidden=8, intermediate=6)
LAYOUT = BankLayout.experts(GEOMETRY, torch.bfloat16)


@pytest.fixture
def identity(tmp_path):
    """Makes identities unique to this test run; removes their segments afterwards."""
    made: list[StoreIdentity] = []

    def make(tag: str = "a") -> StoreIdentity:
        made.append(StoreIdentity(f"test {tag}", f"test pid={os.getpid()} {tmp_path} {tag}"))
        return made[-1]

    yield make
    for ident in made:
        for path in SHM_DIR.glob(ident.name + "*"):
            path.unlink()


def fill_with(value: float, calls: list | None = None):
    def fill(store: ExpertStore) -> None:
        if calls is not None:
            calls.append(store.name)
        for bank in store.host_banks().tensors():
            bank.fill_(value)

    return fill


def reference_weights(geometry: ExpertGeometry, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.w13_shape, generator=g), torch.randn(geometry.w2_shape, generator=g)


def write_checkpoint(directory: Path, names: ExpertNames, w13, w2, dtype, first_layer: int = 0) -> Path:
    """One shard per layer, plus a non-expert tensor, as HF checkpoints are laid out."""
    directory.mkdir()
    inter = w13.shape[2] // 2
    for i in range(w13.shape[0]):
        layer = first_layer + i
        tensors = {f"model.layers.{layer}.self_attn.q_proj.weight": torch.ones(3, 3)}
        if names.gate_up is not None:
            tensors[names.gate_up.format(layer=layer)] = w13[i]
            tensors[names.down.format(layer=layer)] = w2[i]
        for e in range(w13.shape[1] if names.gate_up is None else 0):
            tensors[names.gate.format(layer=layer, expert=e)] = w13[i, e, :inter]
            tensors[names.up.format(layer=layer, expert=e)] = w13[i, e, inter:]
            tensors[names.down.format(layer=layer, expert=e)] = w2[i, e]
        shard = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
        save_file(shard, directory / f"model-{i:05d}-of-{w13.shape[0]:05d}.safetensors")
    return directory


@pytest.mark.parametrize(
    "names, ckpt_dtype, first_layer",
    [
        (MIXTRAL_NAMES, torch.bfloat16, 0),
        (QWEN3_MOE_NAMES, torch.float32, 0),
        (QWEN3_MOE_NAMES, torch.bfloat16, 1),
        (FUSED_NAMES, torch.bfloat16, 0),
    ],
    ids=["mixtral", "qwen3-f32", "qwen3-dense-first", "fused"],
)
def test_fill_from_checkpoint_reads_back(tmp_path, names, ckpt_dtype, first_layer):
    w13, w2 = reference_weights(GEOMETRY)
    ckpt = write_checkpoint(tmp_path / "ckpt", names, w13, w2, ckpt_dtype, first_layer)
    layers = range(first_layer, first_layer + GEOMETRY.num_layers)
    store = open_checkpoint_experts(ckpt, GEOMETRY, torch.bfloat16, layers=layers)
    try:
        assert store.name == StoreIdentity.checkpoint(ckpt, torch.bfloat16).name
        banks = store.host_banks()
        assert banks.w13.shape == GEOMETRY.w13_shape and banks.w13.dtype == torch.bfloat16
        assert torch.equal(banks.w13, w13.to(torch.bfloat16))
        assert torch.equal(banks.w2, w2.to(torch.bfloat16))
        records, offsets = records_of([t.flatten(0, 1) for t in banks.tensors()])  # expert-major: a record an expert
        assert records.shape == (GEOMETRY.num_layers * GEOMETRY.num_experts, store.layout.record_bytes)
        assert records.data_ptr() % ALIGN == 0 and all(o % RECORD_ALIGN == 0 for o in offsets) and offsets[1] > 0
    finally:
        store.path.unlink()


def test_checkpoint_files_follow_the_index(tmp_path):
    w13, w2 = reference_weights(GEOMETRY)
    ckpt = write_checkpoint(tmp_path / "ckpt", MIXTRAL_NAMES, w13, w2, torch.bfloat16)
    shards = sorted(ckpt.glob("*.safetensors"))
    save_file({"x": torch.ones(2)}, ckpt / "consolidated.safetensors")
    assert checkpoint_files(ckpt) == sorted(ckpt.glob("*.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shards[0].name, "b": shards[1].name}}))
    assert checkpoint_files(ckpt) == shards


def test_checkpoint_errors_name_the_tensor_and_leave_no_segment(tmp_path, identity):
    w13, w2 = reference_weights(GEOMETRY)
    ckpt = write_checkpoint(tmp_path / "ckpt", MIXTRAL_NAMES, w13, w2, torch.bfloat16)
    files = sorted(ckpt.glob("*.safetensors"))
    wider = BankLayout.experts(GEOMETRY._replace(hidden=10), torch.bfloat16)
    idents = [identity("shape"), identity("missing"), identity("style")]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight has shape"):
        ExpertStore.open_or_create(idents[0], wider, lambda s: fill_from_safetensors(s, files))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight"):
        ExpertStore.open_or_create(idents[1], LAYOUT, lambda s: fill_from_safetensors(s, files[:1]))
    with pytest.raises(ValueError, match=r"looked for .*gate_up_proj"):
        ExpertStore.open_or_create(idents[2], LAYOUT, lambda s: fill_from_safetensors(s, files, [FUSED_NAMES]))
    for ident in idents:
        assert not list(SHM_DIR.glob(ident.name + "*"))


def test_second_open_reuses_segment_without_fill(identity, caplog):
    caplog.set_level(logging.INFO, logger="sluice.expert_store")
    ident, calls = identity(), []
    first = ExpertStore.open_or_create(ident, LAYOUT, fill_with(1.5, calls))
    assert calls == [ident.name] and first.fill_seconds >= 0
    caplog.clear()
    second = ExpertStore.open_or_create(ident, LAYOUT, fill_with(7.0, calls))
    assert calls == [ident.name]
    assert f"reusing expert store {ident.name}" in caplog.text
    assert "skipped reading the checkpoint, saved ~" in caplog.text
    assert torch.equal(second.host_banks().w13, torch.full(GEOMETRY.w13_shape, 1.5, dtype=torch.bfloat16))
    second.bank("w2")[0, 0, 0, 0] = 3.0  # one segment, two mappings
    assert first.bank("w2")[0, 0, 0, 0].item() == 3.0


def _truncate(path: Path, ident: StoreIdentity, identity) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _bad_magic(path: Path, ident: StoreIdentity, identity) -> None:
    with open(path, "r+b") as f:
        f.write(b"NOTOURS!")


def _incomplete(path: Path, ident: StoreIdentity, identity) -> None:
    with open(path, "r+b") as f:
        f.seek(COMPLETE_OFFSET)
        f.write(b"\0\0\0\0")


def _other_identity(path: Path, ident: StoreIdentity, identity) -> None:
    other = ExpertStore.open_or_create(identity("other"), LAYOUT, fill_with(9.0))
    os.replace(other.path, path)


def _other_layout(path: Path, ident: StoreIdentity, identity) -> None:
    path.unlink()
    ExpertStore.open_or_create(ident, BankLayout.experts(GEOMETRY._replace(num_experts=3), torch.bfloat16), fill_with(9.0))


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_truncate, "size is"),
        (_bad_magic, "foreign magic"),
        (_incomplete, "fill never completed"),
        (_other_identity, "holds another model"),
        (_other_layout, "bank layout differs"),
    ],
)
def test_stale_segment_is_rebuilt(identity, caplog, corrupt, reason):
    caplog.set_level(logging.INFO, logger="sluice.expert_store")
    ident = identity()
    ExpertStore.open_or_create(ident, LAYOUT, fill_with(1.0)).close()
    corrupt(SHM_DIR / ident.name, ident, identity)
    calls: list = []
    store = ExpertStore.open_or_create(ident, LAYOUT, fill_with(2.0, calls))
    assert calls == [ident.name]
    assert f"removing stale expert store {SHM_DIR / ident.name}: {reason}" in caplog.text
    assert torch.equal(store.host_banks().w2, torch.full(GEOMETRY.w2_shape, 2.0, dtype=torch.bfloat16))
    with open(store.path, "rb") as f:
        assert parse_header(f.read(4096)).complete


def test_crashed_fill_is_never_used(identity, caplog):
    caplog.set_level(logging.INFO, logger="sluice.expert_store")
    ident = identity()
    crash = textwrap.dedent(
        f"""
        import os, torch
        from moe_offload.expert_store import ExpertStore
        from moe_offload.store_layout import BankLayout, ExpertGeometry, StoreIdentity
        def fill(store):
            store.bank("w13").fill_(5.0)
            os._exit(3)
        ExpertStore.open_or_create(StoreIdentity({ident.label!r}, {ident.key!r}),
                                   BankLayout.experts(ExpertGeometry{tuple(GEOMETRY)!r}, torch.bfloat16), fill)
        """
    )
    proc = subprocess.run([sys.executable, "-c", crash], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 3
    assert (SHM_DIR / ident.name).exists()
    calls: list = []
    store = ExpertStore.open_or_create(ident, LAYOUT, fill_with(2.0, calls))
    assert calls == [ident.name] and "fill never completed" in caplog.text
    assert torch.equal(store.host_banks().w13, torch.full(GEOMETRY.w13_shape, 2.0, dtype=torch.bfloat16))


def test_concurrent_openers_fill_once(identity):
    ident, calls, stores = identity(), [], []

    def slow_fill(store: ExpertStore) -> None:
        time.sleep(0.2)  # widens the window in which the other opener arrives mid-fill
        fill_with(4.0, calls)(store)

    threads = [threading.Thread(target=lambda: stores.append(ExpertStore.open_or_create(ident, LAYOUT, slow_fill))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [ident.name] and len(stores) == 3
    for store in stores:
        assert torch.equal(store.host_banks().w13, torch.full(GEOMETRY.w13_shape, 4.0, dtype=torch.bfloat16))
    assert [p.name for p in SHM_DIR.glob(ident.name + "*")] == [ident.name]


def test_the_segment_holds_all_its_pages_before_the_fill_writes(identity):
    """Two processes filling stores at once must not run tmpfs out of pages mid-fill (a SIGBUS
    in both, as the GPU suite's workers once died together): the pages are allocated first."""
    held = []

    def fill(store: ExpertStore) -> None:
        held.append(os.stat(store.path).st_blocks * 512)
        fill_with(1.0)(store)

    ExpertStore.open_or_create(identity(), LAYOUT, fill).close()
    assert held and held[0] >= LAYOUT.total_bytes


def test_no_room_for_the_pages_is_one_error_and_leaves_no_segment(identity, monkeypatch):
    import moe_offload.expert_store as expert_store

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(expert_store.os, "posix_fallocate", full)
    ident, calls = identity(), []
    with pytest.raises(OSError, match=r"no room for the expert store's [0-9.]+ GB") as raised:
        ExpertStore.open_or_create(ident, LAYOUT, fill_with(1.0, calls))
    assert raised.value.errno == errno.ENOSPC and calls == []
    assert not list(SHM_DIR.glob(ident.name + "*"))


RACE = """
import sys, time, torch
from moe_offload.expert_store import ExpertStore
from moe_offload.store_layout import BankLayout, ExpertGeometry, StoreIdentity
def fill(store):
    time.sleep(1.0)  # both creators are past the space check before either writes
    for bank in store.host_banks().tensors():
        bank.fill_(1.0)
layout = BankLayout.experts(ExpertGeometry(num_layers=1, num_experts=24, hidden=192, intermediate=192), torch.bfloat16)
try:
    ExpertStore.open_or_create(StoreIdentity("race", sys.argv[1]), layout, fill, shm_dir=sys.argv[2])
    print("filled")
except OSError as e:
    print("refused", e.errno)
"""


def test_two_stores_racing_for_a_small_tmpfs_end_in_one_fill_and_one_enospc(tmp_path):
    """The race itself, on an 8 MB tmpfs where each 5.4 MB store fits alone: without the pages
    reserved first, both pass the space check and one dies of SIGBUS mid-fill."""
    shm = tmp_path / "tmpfs"
    shm.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(shm)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, "-c", RACE, key, str(shm)], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, text=True) for key in ("a", "b")]
        results = [(p.wait(timeout=120), p.stdout.read().strip()) for p in procs]
    finally:
        subprocess.run(["umount", str(shm)])
    assert sorted(results) == [(0, "filled"), (0, f"refused {errno.ENOSPC}")], results


def test_fill_dummy_is_deterministic_by_seed(identity):
    geometry = ExpertGeometry(num_layers=3, num_experts=5, hidden=64, intermediate=48)
    layout = BankLayout.experts(geometry, torch.bfloat16)
    a = ExpertStore.open_or_create(identity("a"), layout, lambda s: fill_dummy(s, seed=7, threads=1))
    b = ExpertStore.open_or_create(identity("b"), layout, lambda s: fill_dummy(s, seed=7, threads=3))
    c = ExpertStore.open_or_create(identity("c"), layout, lambda s: fill_dummy(s, seed=8))
    assert torch.equal(a.host_banks().w13, b.host_banks().w13) and torch.equal(a.host_banks().w2, b.host_banks().w2)
    assert not torch.equal(a.host_banks().w13, c.host_banks().w13)
    w13 = a.host_banks().w13.float()
    assert 0.018 < w13.std().item() < 0.022 and abs(w13.mean().item()) < 0.002
    assert not torch.equal(a.host_banks().w13[0, 0], a.host_banks().w13[0, 1])  # experts differ
    assert StoreIdentity.dummy(geometry, 7, torch.bfloat16).name != StoreIdentity.dummy(geometry, 8, torch.bfloat16).name


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/expert_store.py", *args], cwd=REPO, capture_output=True, text=True)


def _script_main():
    """The script's main() in-process: a subprocess per call would spend seconds importing torch."""
    spec = importlib.util.spec_from_file_location("expert_store_script", REPO / "scripts" / "expert_store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_script_lists_and_removes(tmp_path, capsys):
    shm = tmp_path / "shm"
    shm.mkdir()
    one = ExpertStore.open_or_create(StoreIdentity("model one", "k1"), LAYOUT, fill_with(1.0), shm)
    two = ExpertStore.open_or_create(StoreIdentity("model two", "k2"), LAYOUT, fill_with(1.0), shm)
    (shm / "sluice-experts-garbage").write_bytes(b"x" * 100)
    (shm / "unrelated-file").write_bytes(b"y")
    listed = _script("--dir", str(shm), "list")
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines()[1:-1]}
    assert set(lines) == {one.name, two.name, "sluice-experts-garbage"}
    assert "complete" in lines[one.name] and "model one" in lines[one.name]
    assert "INCOMPLETE" in lines["sluice-experts-garbage"] and "foreign magic" in lines["sluice-experts-garbage"]
    assert sorted(info.complete for info in list_segments(shm)) == [False, True, True]
    removed = _script("--dir", str(shm), "remove", one.name)
    assert removed.returncode == 0 and not one.path.exists() and two.path.exists()
    main = _script_main()
    assert main(["--dir", str(shm), "remove", "unrelated-file"]) == 1
    assert main(["--dir", str(shm), "remove", "--all"]) == 0
    assert sorted(p.name for p in shm.iterdir()) == ["unrelated-file"]
    main(["--dir", str(shm), "list"])
    assert "no expert stores" in capsys.readouterr().out


def test_closed_store_refuses_access(identity):
    store = ExpertStore.open_or_create(identity(), LAYOUT, fill_with(1.0))
    host = store.host_banks()
    store.close()
    assert host.w13[0, 0, 0, 0].item() == 1.0  # earlier views keep the mapping alive
    with pytest.raises(RuntimeError, match="closed"):
        store.host_banks()
    with pytest.raises(RuntimeError, match="register_cuda"):
        store.device_banks()


def test_progress_bar_prints_lines_when_not_a_terminal():
    out = io.StringIO()
    with ProgressBar(4 * 10**9, "filling", out) as bar:
        for _ in range(4):
            bar.advance(10**9)
    assert re.fullmatch(r"filling \[#{30}\] 4\.00/4\.00 GB [\d.]+ GB/s\n", out.getvalue())


@pytest.mark.cuda
def test_register_cuda_device_view_reads_host_pages(identity):
    store = ExpertStore.open_or_create(identity(), LAYOUT, lambda s: fill_dummy(s, seed=3))
    store.register_cuda()
    host = store.host_banks()
    assert host.w13.is_pinned() and store.registered
    dev = store.device_banks()
    assert dev.w13.device.type == "cuda" and dev.w13.shape == host.w13.shape and dev.w13.dtype == torch.bfloat16
    expected = host.w13[1, 2].to("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        read = dev.w13[1, 2] * 1  # kernels reading the mapped host pages in place
        whole = dev.w2.float()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(read, expected)
    assert torch.equal(whole.cpu(), host.w2.float())
    del dev, read, whole
    store.close()
    assert not store.registered and not host.w13.is_pinned()
