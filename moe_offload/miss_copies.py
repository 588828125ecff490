"""Prefill staging that moves only a layer's misses, by the copy engine, with no host read of the plan.

The stage kernel (``kernels.stage_experts``) reads the misses over PCIe with SMs that the layer's
attention wants; the whole-layer memcpy frees the SMs but moves the hits too, because the host
cannot see which experts missed without a device-to-host sync. Here the copy engine moves the
misses alone, and the decision stays on the device:

- three fixed-shape launches read the layer's row of ``slot_for_id``: an expert held at a slot
  ``>= lent`` is a hit, any other a miss (``miss [L, n]``, bool); the GEMM's slot map for the
  buffer is the hit's own slot, or the miss's buffer slot ``b*n + j``;
- a CUDA graph captured per layer holds, for each expert ``j`` of the share, a conditional node
  whose body copies the expert's banks (weights, then any scale banks) from the host into buffer
  slot ``j``; the node's flag is ``miss[layer, j]``, so the copy runs only for a miss.

Hits are not copied at all: the GEMM reads them in place through the slot map (``slots``), so a
layer costs the PCIe bytes of its misses and no SM time but the GEMM's. The captured copies' host
addresses are fixed per layer, which is why there is one graph per layer, and their buffer
(``layer % 2``) follows from the layer. Off CUDA the same flags and map drive a ``torch.where``
copy of the whole layer (the eager twin: identical buffer and map, more bytes read).
"""
from __future__ import annotations

import torch

from moe_offload.expert_records import whole_records

def through_slot_map(slot_map: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pool slots of routed experts at share ``index`` through a layer's ``slot_map [n]`` (a hit's
    own slot, else its buffer slot); -1 (not this share's) stays -1. The index is clamped both ways,
    so no value can read outside the map."""
    return torch.where(index >= 0, slot_map[index.clamp(0, slot_map.numel() - 1)], -1)


def conditional_graphs() -> bool:
    """Whether this torch captures CUDA-graph conditional nodes (``CUDAGraph.begin_capture_to_if_node``;
    torch 2.11 has none, 2.13 has them)."""
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


class MissCopies:
    """Flags, slot maps and per-layer copy graphs of one pipeline (see the module docstring).

    ``banks``: ``(host [L*E, ...], pool [S, ...])`` for the weights and every scale bank; the
    buffer of ``b`` is ``pool[b*n : (b+1)*n]``. ``experts``: the share's expert ids per layer
    (``n`` of them). ``stream``: the copy stream the graphs are captured on (CUDA only).
    """

    def __init__(self, slot_for_id: torch.Tensor, banks: list[tuple[torch.Tensor, torch.Tensor]],
                 num_layers: int, num_experts: int, experts: torch.Tensor, lent: int,
                 stream: torch.cuda.Stream | None = None):
        device = slot_for_id.device
        count = experts.numel()
        # expert records on both sides (``expert_records``): an expert is one copy, not one a bank
        self.slot_for_id, self.banks, self.lent = slot_for_id, whole_records(banks), lent
        self.count = count
        # host bank row of each (layer, share index): the copy sources, and the table entries read
        host_rows = torch.arange(num_layers)[:, None] * num_experts + experts.cpu()[None, :]
        self.rows = host_rows.to(device)
        self.miss = torch.zeros(num_layers, count, dtype=torch.bool, device=device)
        self.slot_map = torch.zeros(2, count, dtype=torch.int32, device=device)
        self.in_place = torch.zeros(num_layers, dtype=torch.int64, device=device)  # hits read from their slots
        self.buffer_slots = torch.arange(2 * count, dtype=torch.int32, device=device).view(2, count)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        if stream is not None and not conditional_graphs():
            raise ValueError(f"prefill stage 'misses' needs CUDA-graph conditional nodes, which torch "
                             f"{torch.__version__} does not expose (CUDAGraph.begin_capture_to_if_node)")
        if stream is not None:
            pool = torch.cuda.graph_pool_handle()  # the copies allocate nothing: one pool for all
            self.graphs = [self._capture(layer, host_rows[layer].tolist(), stream, pool) for layer in range(num_layers)]

    def stage(self, layer: int, staged: torch.Tensor) -> None:
        """Flag the layer's misses, write its buffer's slot map, copy the misses in; count the misses
        into ``staged[layer, 1]`` (``from_host``) and the hits into ``in_place``. Enqueued on the current
        stream (the copy stream); nothing is read back."""
        buf, miss = layer % 2, self.miss[layer]
        held = self.slot_for_id[self.rows[layer]]
        torch.lt(held, self.lent, out=miss)
        torch.where(miss, self.buffer_slots[buf], held, out=self.slot_map[buf])
        misses = miss.sum()
        staged[layer, 1] += misses
        self.in_place[layer] += self.count - misses
        if self.graphs:
            self.graphs[layer].replay()
        else:
            self._copy_eager(layer, buf, miss)

    def slots(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """Pool slots of ``layer``'s routed experts at share ``index`` (its buffer's slot map)."""
        return through_slot_map(self.slot_map[layer % 2], index)

    def _copy_eager(self, layer: int, buf: int, miss: torch.Tensor) -> None:
        for host, pool in self.banks:
            dst = pool[buf * self.count:(buf + 1) * self.count]
            flag = miss.view(-1, *([1] * (dst.dim() - 1)))
            dst.copy_(torch.where(flag, host[self.rows[layer].to(host.device)].to(dst.device), dst))

    def _capture(self, layer: int, rows: list[int], stream: torch.cuda.Stream, pool: tuple) -> torch.cuda.CUDAGraph:
        """One conditional copy node per expert of the share, in a graph replayed by ``stage``."""
        buf, graph = layer % 2, torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):  # not torch.cuda.graph: it collects garbage and syncs per graph
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                for j, row in enumerate(rows):
                    graph.begin_capture_to_if_node(self.miss[layer, j])
                    for host, dst in self.banks:
                        dst[buf * self.count + j].copy_(host[row], non_blocking=True)
                    graph.end_capture_to_conditional_node()
            finally:
                graph.capture_end()
        return graph
