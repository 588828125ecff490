"""fla's tuned configs kept per GPU model (``worker/linear_attention/fla_tuning.py``): merge the dumps
of a GPU run's processes into ``worker/linear_attention/fla_configs/<GPU>/``, tune a model's shapes
there, or list what is kept.

    SLUICE_FLA_DUMP=$OUT/fla pytest -m cuda -n 6 tests/   # on the GPU: each worker dumps its choices
    python scripts/fla_configs.py merge DUMP... --gpu "NVIDIA H200"   # here: into the kept folder
    python scripts/fla_configs.py tune qwen3.5-35b-a3b-geometry [MODEL_DIR ...]   # on a GPU: a model's shapes
    python scripts/fla_configs.py list

``tune`` runs fla's chunked kernels once for each model's linear-attention shape, as serving runs
them (bf16, packed sequences), so that fla tunes the keys a server's warm-up would, and keeps them for
this GPU: a hybrid model's first start on a fresh machine then reads them instead of autotuning.

A DUMP is a folder of fla config files or a folder of such folders (one per worker). Entries merge
by fla's key hash; a later DUMP's choice of a key wins.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from worker.linear_attention.fla_tuning import KEPT, dump, gpu_folder, read, tuned  # noqa: E402


def dump_folders(paths: list[Path]) -> list[Path]:
    """Every folder holding config files among ``paths`` and their subfolders, in order."""
    out = []
    for path in paths:
        out += [path] if any(path.glob("*.json")) else sorted(p for p in path.iterdir() if p.is_dir())
    return out


def merge(paths: list[Path], gpu: str, kept: Path = KEPT) -> tuple[int, Path]:
    """The dumps' entries into ``kept/<gpu>/``; the entries written and the folder."""
    kernels: dict[str, dict[str, dict]] = {}
    for folder in dump_folders(paths):
        for name, entries in read(folder).items():
            kernels.setdefault(name, {}).update(entries)
    target = kept / gpu_folder(gpu)
    return dump(target, kernels), target


def tune(models: list[str], tokens: int) -> dict[str, dict[str, dict]]:
    """fla's chunked kernels run once on this GPU for each model's linear-attention shape (two packed
    sequences of ``tokens`` in all); this process's choices, as ``tuned`` gives them (kept keys
    included: fla reads those instead of tuning them)."""
    import torch

    from worker.config import ModelConfig
    from worker.linear_attention.gated_delta import gated_delta_chunk

    if not torch.cuda.is_available():
        raise SystemExit("tune needs a CUDA GPU: fla tunes its kernels on the card it runs on")
    cuda, bf16 = dict(device="cuda"), dict(device="cuda", dtype=torch.bfloat16)
    for model in models:
        shape = ModelConfig.from_dir(model).linear
        if shape is None:
            raise SystemExit(f"{model} has no linear-attention layers")
        hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
        q, k = (torch.randn(tokens, hk, dk, **bf16) for _ in range(2))
        v, beta = torch.randn(tokens, hv, dv, **bf16), torch.rand(tokens, hv, **bf16)
        g = -torch.rand(tokens, hv, **cuda)
        state = torch.zeros(2, hv, dk, dv, **cuda)
        bounds = [0, tokens // 2, tokens]
        start = time.perf_counter()
        gated_delta_chunk(q, k, v, g, beta, state, torch.arange(2, **cuda), torch.tensor(bounds, dtype=torch.int32,
                                                                                         **cuda), bounds)
        torch.cuda.synchronize()
        print(f"{model}: {hk} key / {hv} value heads of {dk} x {dv}, first run {time.perf_counter() - start:.1f} s "
              "(compiling, and tuning what is not kept)")
    return tuned()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("merge")
    m.add_argument("dumps", nargs="+", type=Path)
    m.add_argument("--gpu", required=True, help="the GPU's name as torch gives it, e.g. 'NVIDIA H200'")
    t = sub.add_parser("tune")
    t.add_argument("models", nargs="+", help="geometry names or checkpoint directories of hybrid models")
    t.add_argument("--tokens", type=int, default=4096, help="tokens of the run (fla's keys do not hold it)")
    sub.add_parser("list")
    args = p.parse_args()
    if args.verb == "tune":
        import torch

        kernels = tune(args.models, args.tokens)
        target = KEPT / gpu_folder(torch.cuda.get_device_name())
        print(f"{dump(target, kernels)} tuned keys -> {target}")
        return
    if args.verb == "merge":
        count, target = merge(args.dumps, args.gpu)
        print(f"{count} tuned keys -> {target}")
        return
    for folder in sorted(p for p in KEPT.glob("*") if p.is_dir()):
        kernels = read(folder)
        print(f"{folder.name}: {len(kernels)} kernels, {sum(map(len, kernels.values()))} tuned keys")


if __name__ == "__main__":
    main()
