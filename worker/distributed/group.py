"""The process groups of an expert-parallel run: one rank per GPU (or per gloo process on CPU).

Two groups over one TCP rendezvous on rank 0:

```
 control  gloo, host tensors   step headers and payloads (rank 0 -> all), start-up sizes
 device   nccl on CUDA, gloo   the experts' all_reduce per MoE layer, the token buffer broadcast
```

Step inputs travel on the host group so that a waiting rank never reads its own device to learn
the next step's shape (a sync that would drain its stream); only fixed-shape device tensors use
the device group, where NCCL enqueues them on the stream like any kernel.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank waits for the next step as long as the server idles; a dead peer is noticed by the
# supervisor and by the closed connection, never by this timeout.
IDLE_TIMEOUT = timedelta(days=30)


def free_address() -> str:
    """``host:port`` of a free local TCP port for the rendezvous (rank 0 binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class RankGroup:
    """This process's place in the run: ``rank`` of ``world``, on ``device``."""

    def __init__(self, rank: int, world: int, address: str, device: torch.device):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                                timeout=IDLE_TIMEOUT)
        self.rank, self.world, self.device = rank, world, device
        self.device_group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def broadcast_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` (int64, on the host) in place on every rank."""
        dist.broadcast(tensor, src=0, group=self.control)
        return tensor

    def broadcast_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's device ``tensor`` in place on every rank, enqueued on the current stream."""
        dist.broadcast(tensor, src=0, group=self.device_group)
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (fixed shape: capturable in a CUDA graph on NCCL)."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
