"""fla's tuned configs kept per GPU model (``worker/linear_attention/fla_tuning.py``): merge the dumps
of a GPU run's processes into ``worker/linear_attention/fla_configs/<GPU>/``, or list what is kept.

    SLUICE_FLA_DUMP=$OUT/fla pytest -m cuda -n 6 tests/   # on the GPU: each worker dumps its choices
    python scripts/fla_configs.py merge DUMP... --gpu "NVIDIA H200"   # here: into the kept folder
    python scripts/fla_configs.py list

A DUMP is a folder of fla config files or a folder of such folders (one per worker). Entries merge
by fla's key hash; a later DUMP's choice of a key wins.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from worker.linear_attention.fla_tuning import KEPT, dump, gpu_folder, read  # noqa: E402


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("merge")
    m.add_argument("dumps", nargs="+", type=Path)
    m.add_argument("--gpu", required=True, help="the GPU's name as torch gives it, e.g. 'NVIDIA H200'")
    sub.add_parser("list")
    args = p.parse_args()
    if args.verb == "merge":
        count, target = merge(args.dumps, args.gpu)
        print(f"{count} tuned keys -> {target}")
        return
    for folder in sorted(p for p in KEPT.glob("*") if p.is_dir()):
        kernels = read(folder)
        print(f"{folder.name}: {len(kernels)} kernels, {sum(map(len, kernels.values()))} tuned keys")


if __name__ == "__main__":
    main()
