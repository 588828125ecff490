"""Stream safetensors tensors into preallocated destinations, checking names and shapes, and
dequantizing quantized (fp8, 4-bit) weights to the destination's dtype."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from moe_offload.checkpoint_matrix import is_stored, read_tensor
from moe_offload.fp8_checkpoint import read_matrix
from moe_offload.progress import ProgressBar
from moe_offload.safetensors_file import SafetensorsFile, index_files
from worker.errors import CheckpointError


def open_checkpoint(files: list[Path]) -> dict[str, SafetensorsFile]:
    """Tensor name -> the shard holding it (headers only; tensors are mapped when read)."""
    return index_files(files)


def load_tensors(files: list[Path], targets: dict[str, torch.Tensor], label: str = "loading",
                 scheme: object = None) -> None:
    """Copy every tensor named in ``targets`` into its destination (casting dtype, moving device);
    a quantized tensor is dequantized with its scales (``scheme``, from ``config.json``) first.

    A missing name, a shape mismatch or a scale that does not fit raises ``CheckpointError``
    naming the tensor; tensors of the file that no target asks for are not read.
    """
    index = open_checkpoint(files)
    missing = sorted(name for name in targets if not is_stored(name, index))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    with ProgressBar(sum(t.numel() * t.element_size() for t in targets.values()), label) as progress:
        for name, dst in targets.items():
            with checkpoint_errors():
                dst.copy_(_read_float(index, name, dst, scheme))
            progress.advance(dst.numel() * dst.element_size())


def _read_float(index: dict[str, SafetensorsFile], name: str, dst: torch.Tensor,
                scheme: object) -> torch.Tensor:
    if dst.dim() != 2:  # norms and other vectors are never quantized
        return read_tensor(index, name, dst.shape)
    # dequantized where it lands: on a GPU that is quicker than a float32 pass on the host
    return read_matrix(index, name, dst.shape, scheme).map(lambda t: t.to(dst.device)).dequantized(dst.dtype)


@contextmanager
def checkpoint_errors():
    """The readers of ``moe_offload`` raise ``ValueError``; entry points print ``CheckpointError``s."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(str(err)) from None
