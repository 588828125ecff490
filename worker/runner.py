"""ModelRunner: loads a checkpoint onto a device and runs one batch (prefill chunks, with any
cached prefix already in the KV pool, or decode tokens), returning logits and sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from moe_offload.experts import Experts
from moe_offload.fp8 import ExpertFormat, resolve_expert_format
from worker.attention import create_backend
from worker.batch import SequenceChunk, build_batch
from worker.config import ModelConfig
from worker.cuda_graph import DecodeGraphs
from worker.device_memory import DeviceMemory
from worker.expert_placement import ExpertOptions, place_experts
from worker.kv.gpu_pool import KVPool
from worker.models.moe_transformer import MoETransformer
from worker.models.weights import ModelWeights
from worker.quantization import checkpoint_expert_format
from worker.routing_options import RoutingOptions, make_routing, save_record
from worker.sampling import Sampling, SamplingTensors, sample

# --max-prefill-tokens 0 (auto): a multiple of AUTO_PREFILL_STEP up to AUTO_PREFILL_MAX on a GPU.
AUTO_PREFILL_STEP = 1024
AUTO_PREFILL_MAX = 32768
AUTO_PREFILL_RESERVE = 8192  # the chunk --moe-cache-auto reserves activations for while the size is auto
CPU_PREFILL_TOKENS = 2048


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    device: str = "auto"  # "auto" = cuda when available
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    kv_tokens: int = 0  # 0 = choose from free memory (GPU) or 16384 (CPU)
    attention: str = "auto"  # "auto" = the Triton kernels on cuda, the torch reference on cpu
    experts: ExpertOptions = ExpertOptions()
    max_prefill_tokens: int = 0  # 0 = auto, see ModelRunner.max_prefill_tokens
    cuda_graph: bool = True  # decode steps of CUDA runners replay captured graphs (worker.cuda_graph)
    cuda_graph_max_batch: int = 64  # larger decode batches run eagerly
    gpu_memory_limit: float | None = None  # GiB: size and cap as if the card had this much (worker.device_memory)
    routing: RoutingOptions = RoutingOptions()

    @property
    def attention_backend(self) -> str:
        if self.attention == "auto":
            return "triton" if self.torch_device.type == "cuda" else "torch"
        return self.attention

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [B, V] float32, each sequence's last token
    next_tokens: torch.Tensor  # [B] int64, on the device


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.memory = DeviceMemory.of(self.device, config.gpu_memory_limit)
        self.memory.cap()
        config.routing.check(config.experts.dummy_weights)  # before loading anything
        self.model_config = cfg = ModelConfig.from_dir(config.model_dir)
        in_store = config.experts.uses_store
        # --expert-dtype, resolved once against the checkpoint's format: the loader, the store and the
        # cache all hold the experts in it
        dummy = config.experts.dummy_weights  # drawn as float experts, whatever the directory holds
        stored = ExpertFormat(self.dtype) if dummy else checkpoint_expert_format(config.model_dir)
        self.expert_format = resolve_expert_format(config.experts.expert_dtype, stored, self.dtype)
        if config.experts.dummy_weights:
            self.weights = ModelWeights.random(cfg, self.dtype, self.device, config.experts.seed, not in_store)
        else:
            self.weights = ModelWeights.load(Path(config.model_dir), cfg, self.dtype, self.device, not in_store,
                                             self.expert_format)
        experts = self._this_rank(place_experts(cfg, config.model_dir, config.experts, self.weights.experts,
                                                self.dtype, self.device, self._activation_bytes(), self.memory,
                                                self.expert_format))
        self.kv_pool = KVPool(cfg.num_layers, self._num_pages(), config.page_size, cfg.num_kv_heads,
                              cfg.head_dim, self.dtype, self.device)
        self.max_prefill_tokens = self._resolve_prefill_tokens()
        attention = create_backend(config.attention_backend, self.kv_pool, cfg.head_dim ** -0.5)
        self.experts = experts
        self.pipeline_from = experts.pipeline_from(cfg.top_k)
        routing = make_routing(config.routing, cfg, self.device, config.experts.dummy_weights)
        self.model = MoETransformer(cfg, self.weights, attention, experts, routing)
        self.graphs = self._decode_graphs()

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int],
                token_buffer: torch.Tensor | None = None) -> ForwardOutput:
        """Run one step. ``steps[b]`` is the index of the token sequence b draws next (seeded
        sampling); chunks with a ``buffer_slot`` read their token from ``token_buffer``. Decode
        batches replayed from a CUDA graph return views that the next step overwrites."""
        if self.graphs is not None and self.graphs.supports(chunks):
            return ForwardOutput(*self.graphs.run(chunks, sampling, steps, token_buffer))
        batch = build_batch(chunks, self.page_size, self.device, token_buffer, self.pipeline_from)
        logits = self.model.forward(batch)
        tensors = SamplingTensors.build(sampling, steps, self.model_config.vocab_size, self.device)
        return ForwardOutput(logits, sample(logits, tensors))

    def stats(self) -> dict[str, int | float | str]:
        """The experts' counters (cache and prefill pipeline, when offloaded); reads the device."""
        return self.experts.stats()

    def reset_stats(self) -> None:
        self.experts.reset_stats()

    def save_routing_record(self) -> None:
        """With ``--record-routing FILE``: write the routing recorded so far to FILE (reads the
        device; the entry points call it when they finish)."""
        if self.config.routing.record is not None:
            save_record(self.model.routing, self.config.routing.record)

    def clear_routing_record(self) -> None:
        """With ``--record-routing``: forget the steps recorded so far (the scheduler's warm-up)."""
        if self.config.routing.record is not None:
            self.model.routing.clear()

    def close(self) -> None:
        """Nothing to release in one process (an expert-parallel rank 0 stops the other ranks)."""

    def _this_rank(self, experts: Experts) -> Experts:
        """The experts this process runs: all of them (``worker.distributed`` runs a share per rank)."""
        return experts

    def _decode_graphs(self) -> DecodeGraphs | None:
        if not (self.config.cuda_graph and self.device.type == "cuda"):
            return None
        cfg = self.model_config
        attention = create_backend("triton", self.kv_pool, cfg.head_dim ** -0.5)
        return DecodeGraphs(self.model, attention, self.kv_pool, cfg.max_context, self.config.cuda_graph_max_batch)

    def _resolve_prefill_tokens(self) -> int:
        """Prompt tokens per prefill chunk. ``max_prefill_tokens`` 0 (auto) picks, on a GPU, the largest
        multiple of 1024 up to 32768 whose activation estimate fits in the memory still free once the
        weights, the expert cache and the KV pool are allocated (at least 1024); 2048 on CPU. Under
        expert offload a chunk costs about the same at any size (every expert streams once per
        chunk), so the biggest chunk that fits gives the most prefill tokens/s."""
        if self.config.max_prefill_tokens:
            return self.config.max_prefill_tokens
        if self.device.type != "cuda":
            return CPU_PREFILL_TOKENS
        free = self.memory.free() + self.memory.reusable()
        context = min(self.model_config.max_context, self.kv_pool.capacity * self.page_size)
        sizes = range(AUTO_PREFILL_MAX, AUTO_PREFILL_STEP - 1, -AUTO_PREFILL_STEP)
        return next((t for t in sizes if self._activation_bytes(t, context) <= free), AUTO_PREFILL_STEP)

    def _activation_bytes(self, tokens: int | None = None, context: int | None = None) -> int:
        """A generous estimate of a prefill chunk's transient memory: per-token activations, the
        logits, and with the torch reference attention its [q, k] boolean mask plus the bf16 bias SDPA
        makes of it, for ``tokens`` attending over up to ``context`` keys (the Triton kernel reads the
        pages in place and needs none)."""
        cfg = self.model_config
        tokens = tokens or self.config.max_prefill_tokens or AUTO_PREFILL_RESERVE
        context = context or cfg.max_context
        per_token = cfg.top_k * (3 * cfg.expert_intermediate_size + 2 * cfg.hidden_size) + 8 * cfg.hidden_size
        logits = tokens * cfg.vocab_size
        mask = 3 * tokens * context if self.config.attention_backend == "torch" else 0
        return 4 * (tokens * per_token + logits) + mask + (1 << 30)

    def _num_pages(self) -> int:
        cfg, c = self.model_config, self.config
        if c.kv_tokens:
            tokens = c.kv_tokens
        elif self.device.type == "cuda":
            # 80% of what is free, and never the activations' share: --moe-cache-auto left that for the
            # prefill chunk, and a pool that took it would shrink the chunk to the minimum
            free = self.memory.free()
            usable = min(int(free * 0.8), free - self._activation_bytes())
            per_token = 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=self.dtype).element_size()
            tokens = min(max(usable, 0) // per_token, 1 << 20)
        else:
            tokens = 16384
        return 1 + -(-tokens // c.page_size)
