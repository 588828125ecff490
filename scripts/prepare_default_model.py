"""Prepare Sluice's default model (SmolLM2-135M-Instruct upcycled to an 8-expert Mixtral) and
print its directory. Progress goes to stderr, so ``MODEL=$(python scripts/prepare_default_model.py)``
works. See worker/default_model.py for the recipe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from worker.default_model import DTYPES, is_prepared, model_cache_dir, prepare_default_model  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exact", action="store_true",
                        help="identical experts (default dtype f32): the MoE equals the dense model")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: the user cache, see worker/default_model.py)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="weight dtype (default: bf16, or f32 with --exact)")
    parser.add_argument("--seed", type=int, default=0, help="seed of expert noise and router weights")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    args = parser.parse_args(argv)

    out = args.out or model_cache_dir(args.exact)
    if args.force or not is_prepared(out):
        dtype = DTYPES[args.dtype] if args.dtype else None
        prepare_default_model(out, exact=args.exact, dtype=dtype, seed=args.seed)
    print(out)
    return out


if __name__ == "__main__":
    main()
