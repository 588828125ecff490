"""The prefill-overlap pipeline: a chunk streams every layer's experts into a double buffer on a
copy stream while the compute stream runs the layer before.

```
 copy:    [wait begin] inval+stage L0->buf0 | inval+stage L1->buf1 | wait release0, inval+stage L2->buf0 | ...
 compute:  record begin     wait ready0, L0 | wait ready1, L1     | wait ready0, L2                      | ...
                               record release0   record release1      record release0
```

The buffer is the cache's slots ``[0, 2E)``, lent as ``w13 [2, E, 2I, H]`` / ``w2 [2, E, H, I]``
(and for quantized experts the same slots of every scale pool, staged beside the weights as bytes);
buffer ``b`` holds layer ``L`` (``b = L % 2``) indexed by expert id, so the grouped GEMM takes the
routed ids as slots. Staging copies experts resident elsewhere in the cache device-to-device and
reads only the rest over PCIe (``kernels.stage_experts``); the host never reads a count.

Why the lent slots stay correct: under the "reserve" lent-slot rule (``OffloadedExperts``) decode
lookups manage only slots ``[2E, S)``, so no table entry points into the buffer. Under the
"decode" rule decode admits into the lent slots too (ranked first as victims, so that they hold the
coldest entries rather than the hot set admitted right after a prefill). Either way staging first
empties buffer ``b``'s ``E`` slots (``invalidate_slots``: one fixed-shape launch that clears
``slot_for_id`` of any expert held there), so no lookup can alias a buffer being overwritten, and
it takes hits only from slots ``>= 2E``; it runs on the copy stream after ``begin``, i.e. after
every decode enqueued earlier has finished with the tables and the slots that staging reads. No
lookup runs inside a pipelined chunk, and after a chunk of two layers or more no entry points into
``[0, 2E)``.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, NamedTuple, Protocol

import torch

from moe_offload.choices import INVALIDATE_MODES, STAGE_MODES, check_choice
from moe_offload.expert_cache import ExpertCache
from moe_offload.expert_records import whole_records
from moe_offload.grouped import ExpertBias, ExpertScales, bias_args, grouped_swiglu
from moe_offload.kernels.invalidate_slots import invalidate_slots, invalidate_slots_eager
from moe_offload.kernels.stage_experts import PROGRAMS, STAGE_FIELDS, check_stage, share_count, stage_banks
from moe_offload.miss_copies import MissCopies
from moe_offload.mirrored_misses import MirroredMisses

# "auto" stages a chunk by the copy engine (from the mirror) from this many matmul FLOPs per byte of
# the layers' experts: 0.08 of the H200's balance point (its 786 TFLOP/s matmul ceiling over 55.3
# GB/s of PCIe), about 1,140. Measured at 25% cache (bench_prefill.py, 2026-12-03): the stage kernel
# won only nvfp4's fresh 2k chunk on qwen3-30b (782 FLOPs a byte, by 4-7%); the mirror won every
# chunk over a 131k prefix, the hybrid's 2k among them (1,690, by 11%), and fresh chunks from 1,432
# up fell within +-3% either way (fp8 8k on qwen3-30b, 2,453; the hybrid's 8k, 1,432).
AUTO_COPY_ENGINE_FLOPS_PER_BYTE = 0.08 * 786e12 / 55.3e9
# ... and at any intensity where a run of misses takes at most this many copies (bf16; fp8, its
# scales bridged): the mirror won every light chunk measured so in bf16 and fp8 on the hybrid
# (2026-12-03/04, fresh 2k chunks and 2k over 131k at 25% and 10%: by 1.5-6%) and matched the
# kernel on qwen3-30b's fresh fp8 chunks; the kernel's one clear win was nvfp4's fresh 2k, whose
# runs take four copies (packed weights and group scales).
AUTO_MIRROR_MAX_COPIES = 2
EVENTS = ("begin", "ready0", "ready1", "release0", "release1")


class ExpertShare(NamedTuple):
    """The experts of each layer a process runs: ``first, first + stride, ...`` (all by default;
    rank r of N under expert parallelism runs ``(r, N)``). The pipeline stages only these, so each
    rank streams its share over its own PCIe link; routes to other experts come as -1."""

    first: int = 0
    stride: int = 1

    def count(self, num_experts: int) -> int:
        return share_count(num_experts, self.first, self.stride)


class PipelineStreams(Protocol):
    """The two streams and the pipeline's named events (``EVENTS``)."""

    def on_copy(self, what: str) -> ContextManager[None]:
        """Enqueue the block's work on the copy stream."""
        ...

    def on_compute(self, what: str) -> ContextManager[None]:
        """Enqueue the block's work on the compute stream (the caller's current stream)."""
        ...

    def record(self, event: str, stream: str) -> None:
        ...

    def wait(self, stream: str, event: str) -> None:
        """Work enqueued later on ``stream`` waits for the event's latest record."""
        ...


class CudaStreams:
    """A dedicated copy stream; the compute stream is whatever stream is current at each call."""

    def __init__(self, device: torch.device, events: tuple[str, ...] = EVENTS):
        self.device = device
        self.copy = torch.cuda.Stream(device)
        self.events = {name: torch.cuda.Event() for name in events}

    def _stream(self, name: str) -> torch.cuda.Stream:
        return self.copy if name == "copy" else torch.cuda.current_stream(self.device)

    def on_copy(self, what: str) -> ContextManager[None]:
        return torch.cuda.stream(self.copy)

    def on_compute(self, what: str) -> ContextManager[None]:
        return contextlib.nullcontext()

    def record(self, event: str, stream: str) -> None:
        self.events[event].record(self._stream(stream))

    def wait(self, stream: str, event: str) -> None:
        self._stream(stream).wait_event(self.events[event])


class HostStreams:
    """Off CUDA everything runs in program order; with ``log`` the calls are recorded as tuples
    ``("record", event, stream)``, ``("wait", stream, event)``, ``("copy" | "compute", what)``."""

    def __init__(self, log: list[tuple[str, ...]] | None = None):
        self.log = log

    def _note(self, *entry: str) -> None:
        if self.log is not None:
            self.log.append(entry)

    @contextlib.contextmanager
    def on_copy(self, what: str):
        self._note("copy", what)
        yield

    @contextlib.contextmanager
    def on_compute(self, what: str):
        self._note("compute", what)
        yield

    def record(self, event: str, stream: str) -> None:
        self._note("record", event, stream)

    def wait(self, stream: str, event: str) -> None:
        self._note("wait", stream, event)


class PrefillPipeline:
    """Runs prefill-sized MoE layers from a double buffer lent by ``cache``.

    The cache must have at least ``2n + E`` slots for the ``n`` experts of ``share`` per layer
    (``2n`` lent, ``E`` for decode lookups, the least one of them admits; ``3E`` unshared); a
    smaller one raises ``ValueError`` (``place_experts`` then runs without the pipeline).
    ``host_w13 [L*E, 2I, H]``, ``host_w2 [L*E, H, I]`` are the banks the misses are read from (device-addressable on CUDA), with ``host_scales`` (every scale bank, ``[L*E, ...]``) for a quantized cache.
    Layers must come in order ``0, 1, ..., L-1`` per chunk.
    """

    def __init__(self, cache: ExpertCache, host_w13: torch.Tensor, host_w2: torch.Tensor,
                 invalidate: str = "fixed", streams: PipelineStreams | None = None, stage: str = "kernel",
                 host_scales: ExpertScales | None = None, share: ExpertShare = ExpertShare(),
                 programs: int = PROGRAMS):
        num_experts, count = cache.num_experts, share.count(cache.num_experts)
        if cache.num_slots < 2 * count + num_experts:
            raise ValueError(f"the prefill pipeline lends 2x{count} slots and leaves {num_experts} to decode: "
                             f"it needs a cache of {2 * count + num_experts} slots, this one has {cache.num_slots}")
        check_choice("invalidate mode", invalidate, INVALIDATE_MODES)
        check_choice("stage mode", stage, STAGE_MODES)
        if (host_scales is None) != (cache.scales is None):
            raise ValueError("a quantized cache stages from host scales, a float one from none")
        self.stage, self.programs = stage, programs  # programs: the stage kernel's CTAs
        self.chunks = dict.fromkeys(STAGE_MODES[:-1], 0)  # chunks staged each way
        self.cache = cache
        self.host_w13, self.host_w2 = host_w13, host_w2
        self.invalidate = invalidate
        self.share, self.count = share, count  # experts staged per layer
        self.lent = 2 * count
        self.buf_w13 = cache.w13[:self.lent].view(2, count, *cache.w13.shape[1:])
        self.buf_w2 = cache.w2[:self.lent].view(2, count, *cache.w2.shape[1:])
        # per buffer: the (pool, host, buffer) scale banks staging copies, and the GEMM's scales
        self.buf_scales = [self._scale_banks(cache, host_scales, b, count) for b in range(2)]
        self.gemm_scales = [host_scales.with_tensors([buf for _, _, buf in banks]) if banks else None
                            for banks in self.buf_scales]
        self.layer_copies = [self._layer_copies(b) for b in range(2)]  # "memcpy": (host, buffer) pairs
        device = cache.w13.device
        self.streams = streams or (CudaStreams(device) if device.type == "cuda" else HostStreams())
        # experts staged per layer, by source (STAGE_FIELDS); device counters, read by stats()
        self.staged = torch.zeros(cache.num_layers, len(STAGE_FIELDS), dtype=torch.int64, device=device)
        self.stage_banks = [self._stage_banks(b) for b in range(2)]  # the stage kernel's, checked and resolved
        self.misses = self._miss_copies(host_scales) if stage == "misses" else None
        self.mirrored = self._mirrored_misses(host_scales) if stage in ("mirror", "auto") else None
        self.chunk_stage = "kernel" if stage == "auto" else stage  # this chunk's, chosen by begin
        self._next_layer = 0
        self._begun = False

    def begin(self, flops: float = 0.0) -> None:
        """Start a chunk early: called before layer 0's attention, so staging layer 0 overlaps it
        instead of waiting for the first MoE layer. ``flops``, the chunk's estimated matmul work,
        picks the stage mode under "auto"."""
        if self.stage == "auto":  # the copy engine from the mirror once the stage kernel's SMs cost more
            expert_bytes = self.cache.num_layers * self.count * self.cache.slot_bytes
            heavy = flops >= AUTO_COPY_ENGINE_FLOPS_PER_BYTE * expert_bytes
            few_copies = self.mirrored.copies_per_run <= AUTO_MIRROR_MAX_COPIES
            self.chunk_stage = "mirror" if heavy or few_copies else "kernel"
        self._begin()
        self._begun = True

    def forward(self, layer: int, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                out_dtype: torch.dtype | None = None, bias: ExpertBias | None = None,
                activation: str = "silu") -> torch.Tensor:
        """One layer of a chunk: stage the next layer, wait for this one, run the grouped GEMM."""
        if layer == 0 and not self._begun:
            self._begin()
        elif layer != self._next_layer:
            raise RuntimeError(f"prefill pipeline: layer {layer} called, layer {self._next_layer} was staged")
        if layer + 1 < self.cache.num_layers:
            self._stage(layer + 1)
        buf = layer % 2
        self.streams.wait("compute", f"ready{buf}")
        with self.streams.on_compute(f"layer {layer} from buffer {buf}"):
            if self.chunk_stage in ("misses", "mirror"):  # hits in place in the cache, misses in the buffer
                staging = self.misses if self.chunk_stage == "misses" else self.mirrored
                slots = staging.slots(layer, self._buffer_slots(ids))
                w13, w2, scales = self.cache.w13, self.cache.w2, self.cache.scales
            else:
                slots = self._buffer_slots(ids)
                w13, w2, scales = self.buf_w13[buf], self.buf_w2[buf], self.gemm_scales[buf]
            out = grouped_swiglu(hidden, weights, slots, w13, w2, scales=scales, out_dtype=out_dtype,
                                 activation=activation, groups=self.cache.num_experts, **bias_args(bias, ids))
        self.streams.record(f"release{buf}", "compute")
        self._next_layer = layer + 1
        self._begun = False
        return out

    def _buffer_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed expert ids -> buffer slots: the ids themselves unshared; under a share, expert
        ``first + stride * j`` sits in slot ``j`` (routes to others' experts stay -1)."""
        first, stride = self.share
        if stride == 1 and first == 0:
            return ids
        return torch.where(ids >= 0, (ids - first) // stride, -1)

    def _begin(self) -> None:
        # fences every decode enqueued before this chunk: its lookups and gathers write the tables
        # and the cache slots that staging reads
        self.streams.record("begin", "compute")
        self.streams.wait("copy", "begin")
        self.chunks[self.chunk_stage] += 1
        if self.chunk_stage == "mirror":
            with self.streams.on_copy("plan the chunk's copies from the mirror"):
                self.mirrored.plan(self.staged)
        self._stage(0)
        self._next_layer = 0

    def _stage(self, layer: int) -> None:
        buf, num_experts, count = layer % 2, self.cache.num_experts, self.count
        self.streams.wait("copy", f"release{buf}")  # the layer two back is done reading this buffer
        with self.streams.on_copy(f"layer {layer} to buffer {buf}"):
            if self.invalidate == "fixed":
                invalidate_slots(buf * count, count, self.cache.tables, self.cache.backend)
            else:
                invalidate_slots_eager(buf * count, count, self.cache.tables)
            if self.chunk_stage == "misses":
                self.misses.stage(layer, self.staged)
            elif self.chunk_stage == "mirror":
                self.mirrored.stage(layer)
                if layer == self.cache.num_layers - 1:  # the next chunk plans from the tables as they are now
                    self.mirrored.refresh(beside=False)
            elif self.chunk_stage == "memcpy":
                # a share is strided in the host bank: then a copy kernel, not the copy engine, moves it
                experts = slice(layer * num_experts + self.share.first, (layer + 1) * num_experts, self.share.stride)
                for host, dst in self.layer_copies[buf]:
                    dst.copy_(host[experts], non_blocking=True)
                self.staged[layer, 1] += count
            else:
                stage_banks(layer, num_experts, self.lent, self.cache.tables.slot_for_id, self.stage_banks[buf],
                            self.staged, self.cache.backend, self.programs, self.share.first, self.share.stride)
        self.streams.record(f"ready{buf}", "copy")

    def _miss_copies(self, host_scales: ExpertScales | None) -> MissCopies:
        """The misses-only staging of this pipeline's share: on CUDA its copy graphs are captured on
        the copy stream here, once."""
        cache = self.cache
        stream = self.streams.copy if isinstance(self.streams, CudaStreams) else None
        return MissCopies(cache.tables.slot_for_id, self._host_banks(host_scales), cache.num_layers,
                          cache.num_experts, self._share_experts(), self.lent, stream)

    def _mirrored_misses(self, host_scales: ExpertScales | None) -> MirroredMisses:
        """The staging planned on the host from a mirror of the table, for this pipeline's share."""
        cache = self.cache
        return MirroredMisses(cache.tables.slot_for_id, self._host_banks(host_scales), cache.num_layers,
                              cache.num_experts, self._share_experts(), self.lent, cache.backend)

    def _host_banks(self, host_scales: ExpertScales | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(host bank, pool)`` of the weights and every scale bank."""
        banks = [(self.host_w13, self.cache.w13), (self.host_w2, self.cache.w2)]
        if host_scales is not None:
            banks += list(zip(host_scales.tensors(), self.cache.scales.tensors()))
        return banks

    def _share_experts(self) -> torch.Tensor:
        return torch.arange(self.share.first, self.cache.num_experts, self.share.stride)

    def lookups_done(self) -> None:
        """A decode step has made its last lookup: under "mirror", copy the tables into the host's
        mirror beside the step's remaining work (``lookups_joined`` rejoins it)."""
        if self.mirrored is not None:
            self.mirrored.refresh()

    def lookups_joined(self) -> None:
        if self.mirrored is not None:
            self.mirrored.join()

    def _stage_banks(self, buf: int) -> list[tuple[torch.Tensor, ...]]:
        """What the stage kernel moves into buffer ``buf``: ``(pool, host, buffer)`` of each bank,
        checked here once (``check_stage``), or one such triple of expert records where all three
        are records (``expert_records``: one launch a layer)."""
        cache = self.cache
        banks = [(cache.w13, self.host_w13, self.buf_w13[buf]), (cache.w2, self.host_w2, self.buf_w2[buf]),
                 *self.buf_scales[buf]]
        check_stage(0, cache.num_experts, self.lent, cache.tables.slot_for_id, banks, self.staged, self.count)
        return whole_records(banks)

    def _layer_copies(self, buf: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What "memcpy" copies into buffer ``buf``: ``(host, buffer)`` of each bank, or one pair of
        expert records where both sides are records (``expert_records``: a layer in one copy)."""
        pairs = [(self.host_w13, self.buf_w13[buf]), (self.host_w2, self.buf_w2[buf])]
        pairs += [(host, dst) for _, host, dst in self.buf_scales[buf]]
        return whole_records(pairs)

    @staticmethod
    def _scale_banks(cache: ExpertCache, host_scales: ExpertScales | None, buf: int,
                     count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(pool, host, buffer b's view)`` of each scale bank; empty for float experts."""
        if host_scales is None:
            return []
        return [(pool, host, pool[buf * count:(buf + 1) * count])
                for pool, host in zip(cache.scales.tensors(), host_scales.tensors())]

    def reset_stats(self) -> None:
        self.staged.zero_()
        if self.misses is not None:
            self.misses.in_place.zero_()
        if self.mirrored is not None:
            self.mirrored.reset_stats()
        self.chunks = dict.fromkeys(self.chunks, 0)

    def stats(self) -> dict:
        """Experts staged from the cache and from the host, hits read in place (``misses`` chunks),
        the bytes moved, chunks per stage mode; reads the device, so call it off the hot path."""
        from_cache, from_host = (int(v) for v in self.staged.sum(0).tolist())
        in_place = sum(int(staging.in_place.sum()) for staging in (self.misses, self.mirrored) if staging is not None)
        mirror = self.mirrored.stats() if self.mirrored is not None else {}
        return {**mirror, "from_cache": from_cache, "from_host": from_host, "in_place": in_place,
                "bytes_h2d": from_host * self.cache.slot_bytes, "bytes_d2d": from_cache * self.cache.slot_bytes,
                **{f"chunks_{mode}": n for mode, n in self.chunks.items()}}
