"""ModelRunner: loads a checkpoint onto a device and runs one batch (prefill chunks, with any
cached prefix already in the KV pool, or decode tokens), returning logits and sampled tokens."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from moe_offload.experts import Experts
from moe_offload.formats import ExpertFormat, resolve_expert_format
from worker import compile_watch
from worker.attention import create_backend
from worker.batch import SequenceChunk, build_batch
from worker.config import ModelConfig
from worker.cuda_graph import DecodeGraphs, Launched
from worker.device_memory import DeviceMemory
from worker.expert_placement import expert_slot_bytes, open_store, place_experts
from worker.kv.gpu_pool import KV_DTYPES, KVPool
from worker.kv.state_pool import StatePool
from worker.memory_plan import MemoryPlan, PlanInputs, host_available_bytes, plan_memory
from worker.models.moe_transformer import MoETransformer
from worker.models.weights import ModelWeights
from worker.errors import CheckpointError
from worker.expert_format import check_fits, checkpoint_expert_format
from worker.routing import make_routing, save_record
from worker.runner_config import RunnerConfig
from worker.sampling import Sampling, SamplingTensors, sample
from worker.token_mask import TokenMask

log = logging.getLogger("sluice.worker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_device(config: RunnerConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def torch_dtype(config: RunnerConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def kv_dtype(config: RunnerConfig, dtype: torch.dtype) -> torch.dtype:
    """What the KV pools hold: ``--kv-cache-dtype``, or the compute ``dtype``."""
    return KV_DTYPES[config.kv_cache_dtype] or dtype


def window_layers(cfg: ModelConfig) -> int:
    """Layers whose KV lives in the window pool: gpt-oss's sliding layers."""
    return sum(1 for i in range(cfg.num_layers) if cfg.window(i))


def attention_backend(config: RunnerConfig, device: torch.device) -> str:
    if config.attention == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return config.attention


def expert_format(cfg: ModelConfig, config: RunnerConfig, dtype: torch.dtype) -> ExpertFormat:
    """``--expert-dtype``, resolved once against the checkpoint's format: the loader, the store and
    the cache all hold the experts in it (dummy weights are drawn as float experts, whatever the
    directory holds)."""
    dummy = config.experts.dummy_weights
    stored = ExpertFormat(dtype) if dummy else checkpoint_expert_format(config.model_dir)
    fmt = resolve_expert_format(config.experts.expert_dtype, stored, dtype)
    if cfg.expert_bias and fmt.family == "fp8":  # no fp8 kernel takes biases
        raise CheckpointError(f"{config.model_dir}: fp8 experts with biases (gpt-oss) are not supported; "
                              f"use --expert-dtype bf16 or the checkpoint's own format")
    check_fits(cfg, fmt)
    return fmt


def plan_inputs(cfg: ModelConfig, config: RunnerConfig, fmt: ExpertFormat, dtype: torch.dtype, device: torch.device,
                gpu_free: int | None, gpu_reusable: int) -> PlanInputs:
    """What the memory plan splits and the units it splits it in, for ``cfg`` under ``config`` with
    experts in ``fmt``: ``gpu_free`` is the GPU memory free once the weights are loaded (None: no GPU)."""
    kv_bytes = 2 * cfg.kv_size * kv_dtype(config, dtype).itemsize  # K and V of a token in one layer
    return PlanInputs(gpu_free=gpu_free, gpu_reusable=gpu_reusable, host_available=host_available_bytes(),
                      slot_bytes=expert_slot_bytes(cfg, fmt),
                      kv_token_bytes=(cfg.num_kv_layers - window_layers(cfg)) * kv_bytes,
                      torch_attention=attention_backend(config, device) == "torch",
                      window_token_bytes=window_layers(cfg) * kv_bytes)


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [B, V] float32, each sequence's last token
    next_tokens: torch.Tensor  # [B] int64, on the device


class LaunchedStep(NamedTuple):
    """A step whose forward is launched and whose sampling is not: a decode graph's, or eager
    logits with their sampling tensors."""

    logits: torch.Tensor | None = None
    tensors: SamplingTensors | None = None
    graph: Launched | None = None


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        self.config = config
        self.compiles = compile_watch.install()
        self.device = torch_device(config)
        self.dtype = torch_dtype(config, self.device)
        self.memory = DeviceMemory.of(self.device, config.gpu_memory_limit)
        self.memory.cap()
        config.routing.check(config.experts.dummy_weights)  # before loading anything
        self.model_config = cfg = ModelConfig.from_dir(config.model_dir)
        self._check_model(cfg)
        self.expert_format = expert_format(cfg, config, self.dtype)
        self.weights = self._load_weights()
        store = open_store(cfg, config.model_dir, config.experts, self.expert_format, self.device)
        self.state_pool = self._state_pool()
        self.plan = self._plan()
        self.experts = self._this_rank(place_experts(cfg, config.experts, self.weights.experts, store,
                                                     self.plan.expert_slots, self.device))
        self.kv_pool = KVPool(cfg.num_kv_layers - window_layers(cfg), self.plan.kv_pages, config.page_size,
                              cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device, kv_dtype(config, self.dtype))
        self.window_pool = self._window_pool()
        backend = attention_backend(config, self.device)
        attention = create_backend(backend, self.kv_pool, cfg.head_dim ** -0.5)
        windowed = create_backend(backend, self.window_pool, cfg.head_dim ** -0.5) if self.window_pool else None
        routing = make_routing(config.routing, cfg, self.device, config.experts.dummy_weights)
        self.pipeline_from = self.experts.pipeline_from(cfg.top_k)
        self.model = MoETransformer(cfg, self.weights, attention, self.experts, routing, self.state_pool, windowed)
        self.graphs = self._decode_graphs()

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int],
                token_buffer: torch.Tensor | None = None, mask: TokenMask | None = None) -> ForwardOutput:
        """Run one step. ``steps[b]`` is the index of the token sequence b draws next (seeded
        sampling); chunks with a ``buffer_slot`` read their token from ``token_buffer``; ``mask``
        constrains the sequences it names a row for (grammars). Decode batches replayed from a CUDA
        graph return views that the next step overwrites."""
        return self.sample(self.launch(chunks, sampling, steps, token_buffer, mask))

    @torch.inference_mode()
    def launch(self, chunks: list[SequenceChunk], sampling: list[Sampling], steps: list[int],
               token_buffer: torch.Tensor | None = None, mask: TokenMask | None = None) -> LaunchedStep:
        """``forward`` up to the logits; ``sample`` finishes it. ``mask.words`` is read (in stream
        order) by ``sample`` only, so the host may fill and copy it in between: a constrained step's
        forward runs while the host reads the step before it and builds the mask."""
        if mask is not None:
            mask.check(len(chunks))
        if self.graphs is not None and self.graphs.supports(chunks):
            return LaunchedStep(graph=self.graphs.launch(chunks, sampling, steps, token_buffer, mask))
        batch = build_batch(chunks, self.page_size, self.device, token_buffer, self.pipeline_from,
                            self.window_pool.num_pages if self.window_pool else 0, self.model_config.sliding_window)
        logits = self.model.forward(batch)
        tensors = SamplingTensors.build(sampling, steps, self.model_config.vocab_size, self.device, mask)
        return LaunchedStep(logits, tensors)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> ForwardOutput:
        if step.graph is not None:
            return ForwardOutput(*self.graphs.sample(step.graph))
        return ForwardOutput(step.logits, sample(step.logits, step.tensors))

    def stats(self) -> dict[str, int | float | str]:
        """The experts' counters (cache and prefill pipeline, when offloaded; reads the device) and
        what was compiled or planned after warm-up."""
        return {**self.experts.stats(), **self.compiles.stats()}

    def reset_stats(self) -> None:
        self.experts.reset_stats()

    def warm_attention_plans(self) -> int:
        """Plan the long-prefix attention for every shape a prefill chunk can launch (the
        scheduler's warm-up); returns how many. gpt-oss's layers never take that path."""
        cfg = self.model_config
        if cfg.attention_sinks:
            return 0
        return self.model.attention.warm_plans(cfg.num_heads, self.plan.prefill_tokens, cfg.max_context)

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

    def _check_model(self, cfg: ModelConfig) -> None:
        """What this runner cannot run, refused before anything loads (an expert-parallel rank's)."""

    def _this_rank(self, experts: Experts) -> Experts:
        """The experts this process runs: all of them (``worker.distributed`` runs a share per rank)."""
        return experts

    def _decode_graphs(self) -> DecodeGraphs | None:
        if not (self.config.cuda_graph and self.device.type == "cuda"):
            return None
        cfg = self.model_config
        attention = create_backend("triton", self.kv_pool, cfg.head_dim ** -0.5)
        windowed = create_backend("triton", self.window_pool, cfg.head_dim ** -0.5) if self.window_pool else None
        return DecodeGraphs(self.model, attention, self.kv_pool, cfg.max_context, self.config.cuda_graph_max_batch,
                            window_attention=windowed)

    def _window_pool(self) -> KVPool | None:
        """gpt-oss's sliding layers' pool of window pages (the memory plan sized it); None without
        sliding layers."""
        if not self.plan.window_pages:
            return None
        cfg = self.model_config
        return KVPool(window_layers(cfg), self.plan.window_pages, self.config.page_size, cfg.num_kv_heads,
                      cfg.head_dim, self.dtype, self.device, kv_dtype(self.config, self.dtype))

    def _load_weights(self) -> ModelWeights:
        c, cfg = self.config, self.model_config
        with_experts = not c.experts.uses_store
        if c.experts.dummy_weights:
            return ModelWeights.random(cfg, self.dtype, self.device, c.experts.seed, with_experts)
        return ModelWeights.load(Path(c.model_dir), cfg, self.dtype, self.device, with_experts, self.expert_format)

    def _state_pool(self) -> StatePool | None:
        """A hybrid model's recurrent-state slots, allocated before the memory plan splits what is
        left: a slot per running request and the prefix cache's snapshots."""
        cfg, c = self.model_config, self.config
        if not cfg.is_hybrid:
            return None
        layers = len(cfg.linear_layers)
        slot_bytes = StatePool.slot_bytes_of(layers, cfg.linear, self.dtype)
        snapshots = c.state_snapshots or 2 * c.state_slots
        if not c.state_snapshots and self.device.type == "cuda":
            snapshots = min(snapshots, int(0.1 * self.memory.free()) // slot_bytes)
        return StatePool(layers, c.state_slots, max(snapshots, 0), cfg.linear, self.dtype, self.device)

    def _plan(self) -> MemoryPlan:
        """The memory plan, from the memory free now that the weights are loaded (logged once)."""
        cfg, on_gpu = self.model_config, self.device.type == "cuda"
        inputs = plan_inputs(cfg, self.config, self.expert_format, self.dtype, self.device,
                             self.memory.free() if on_gpu else None, self.memory.reusable() if on_gpu else 0)
        plan = plan_memory(inputs, cfg, self.config)
        if self.state_pool is not None:
            pool = self.state_pool
            plan = replace(plan, state_bytes=pool.num_slots * pool.slot_bytes,
                           state_slots=(pool.running, pool.capacity))
        log.info("%s", plan.table(cfg.num_layers * cfg.num_experts,
                                  f"{self.expert_format.name} experts, policy {self.config.experts.policy}"))
        return plan
