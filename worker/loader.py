"""Stream safetensors tensors into preallocated destinations, checking names and shapes, and
dequantizing fp8 weights to the destination's dtype."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from moe_offload.fp8_checkpoint import FP8Scheme, StoredMatrix, dequantized, read_matrix, read_tensor
from moe_offload.progress import ProgressBar
from moe_offload.safetensors_file import SafetensorsFile, index_files
from worker.errors import CheckpointError


def open_checkpoint(files: list[Path]) -> dict[str, SafetensorsFile]:
    """Tensor name -> the shard holding it (headers only; tensors are mapped when read)."""
    return index_files(files)


def load_tensors(files: list[Path], targets: dict[str, torch.Tensor], label: str = "loading",
                 scheme: FP8Scheme | None = None) -> None:
    """Copy every tensor named in ``targets`` into its destination (casting dtype, moving device);
    an fp8 tensor is dequantized with its scale (``scheme``, from ``config.json``) first.

    A missing name, a shape mismatch or a scale that does not fit raises ``CheckpointError``
    naming the tensor; tensors of the file that no target asks for are not read.
    """
    index = open_checkpoint(files)
    missing = sorted(set(targets) - set(index))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    with ProgressBar(sum(t.numel() * t.element_size() for t in targets.values()), label) as progress:
        for name, dst in targets.items():
            with checkpoint_errors():
                dst.copy_(_read_float(index, name, dst, scheme))
            progress.advance(dst.numel() * dst.element_size())


def _read_float(index: dict[str, SafetensorsFile], name: str, dst: torch.Tensor,
                scheme: FP8Scheme | None) -> torch.Tensor:
    if dst.dim() != 2:  # norms and other vectors are never quantized
        return read_tensor(index, name, dst.shape)
    weight, scale = read_matrix(index, name, dst.shape, scheme)
    # dequantized where it lands: on a GPU that is quicker than a float32 pass on the host
    moved = StoredMatrix(weight.to(dst.device), None if scale is None else scale.to(dst.device))
    return dequantized(moved, scheme, dst.dtype)


@contextmanager
def checkpoint_errors():
    """The readers of ``moe_offload`` raise ``ValueError``; entry points print ``CheckpointError``s."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(str(err)) from None
