"""What a ModelRunner is built from: one frozen ``RunnerConfig`` (with its ``ExpertOptions`` and
``RoutingOptions``), defaults declared once, here. Without torch, so that the command line's
``--help`` (``worker.cli_options``) reads defaults and choices without importing it.

    RunnerConfig ⊂ scheduler.config.SchedulerConfig (the scheduler process's options)

The memory fields are the inputs of the memory plan (``worker.memory_plan``), which resolves every
"0 / None: from free memory" once, at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from worker.routing_options import RoutingOptions

DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto": bfloat16 on cuda, float32 on cpu
ATTENTION_BACKENDS = ("torch", "triton")  # the names worker.attention registers (a test checks)
EXPERT_PLACEMENTS = ("round-robin", "popularity:FILE")  # worker.distributed.placement
KV_CACHE_DTYPES = ("auto", "fp8")  # worker.kv.gpu_pool.KV_DTYPES; "auto": the compute dtype


@dataclass(frozen=True)
class ExpertOptions:
    """Where the experts run from: resident on the device (no cache option, no dummy weights), or
    the shared-memory expert store behind a GPU expert cache of one of ``cache_size`` slots,
    ``cache_fraction`` of all experts or ``cache_auto`` (what the memory plan leaves)."""

    cache_size: int | None = None  # slots
    cache_fraction: float | None = None  # of all experts
    cache_auto: bool = False  # fill the GPU memory left after weights, activations and a KV floor
    policy: str = "lfru"  # moe_offload.choices.POLICIES
    kv_reserve_tokens: int = 32768  # the KV floor cache_auto leaves
    dummy_weights: bool = False
    seed: int = 0
    prefill_pipeline: bool = True  # stream prefill chunks' experts through a double buffer (needs 3E slots)
    prefill_invalidate: str = "fixed"  # moe_offload.choices.INVALIDATE_MODES
    prefill_stage: str = "auto"  # moe_offload.choices.STAGE_MODES
    expert_dtype: str = "auto"  # moe_offload.choices.EXPERT_DTYPES
    lent_slots: str = "decode"  # moe_offload.choices.LENT_SLOT_RULES; the better of the two on an H200 (architecture.md)
    # cross-layer prefetch at decode (moe_offload.expert_prefetch); off until measured on the H200
    prefetch: bool = False
    prefetch_cap: int = 0  # guessed misses a layer the prefetch admits, most likely first (0: all that fit)
    fill: str = "gemm"  # moe_offload.choices.FILL_MODES: how decode copies misses in

    def __post_init__(self) -> None:
        """The one check of the cache size options (the command line and the plan rely on it)."""
        given = [name for name, value in (("--moe-cache-size", self.cache_size),
                                          ("--moe-cache-fraction", self.cache_fraction),
                                          ("--moe-cache-auto", self.cache_auto or None)) if value is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are mutually exclusive")
        if self.cache_fraction is not None and not 0.0 < self.cache_fraction <= 1.0:
            raise ValueError(f"--moe-cache-fraction must be in (0, 1], got {self.cache_fraction:g}")
        if self.prefetch_cap < 0 or (self.prefetch_cap and not self.prefetch):
            raise ValueError(f"--expert-prefetch-cap {self.prefetch_cap}: a count of experts a layer (0: none), "
                             "with --expert-prefetch on")

    @property
    def uses_store(self) -> bool:
        """Experts come from the expert store (a cache size was given, or dummy weights, which
        are written straight into the store)."""
        return self.cache_size is not None or self.cache_fraction is not None or self.cache_auto \
            or self.dummy_weights


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    device: str = "auto"  # "auto" = cuda when available
    dtype: str = "auto"  # DTYPES
    page_size: int = 16
    kv_tokens: int = 0  # memory plan: 0 = from free memory (GPU) or 16384 (CPU)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: what the KV pools (and the host tier) hold
    attention: str = "auto"  # "auto" = the Triton kernels on cuda, the torch reference on cpu
    experts: ExpertOptions = ExpertOptions()
    max_prefill_tokens: int = 0  # memory plan: 0 = the largest chunk that fits (GPU), 2048 (CPU)
    cuda_graph: bool = True  # decode steps of CUDA runners replay captured graphs (worker.cuda_graph)
    cuda_graph_max_batch: int = 64  # larger decode batches run eagerly
    gpu_memory_limit: float | None = None  # GiB: plan and cap as if the card had this much (worker.device_memory)
    routing: RoutingOptions = RoutingOptions()
    kv_host_size: float | None = None  # memory plan: host KV tier GiB; None = 25% of available RAM (GPU), 0 (CPU)
    gpus: int = 1  # expert-parallel ranks (worker.distributed.parallel_runner.start_runner)
    # sequences running at once (the scheduler's --max-running): hybrid models' recurrent-state slots, and
    # the memory plan's logits rows of a prefill chunk; the prefix cache's state snapshots on the GPU
    # (0: twice the running slots, within 10% of free memory)
    state_slots: int = 64
    state_snapshots: int = 0
    expert_placement: str = "round-robin"  # EXPERT_PLACEMENTS: which rank runs which expert

    def __post_init__(self) -> None:
        for flag, value in (("--kv-tokens", self.kv_tokens), ("--max-prefill-tokens", self.max_prefill_tokens),
                            ("--kv-host-size", self.kv_host_size or 0)):
            if value < 0:
                raise ValueError(f"{flag} must be 0 or more, got {value:g}")
        if self.gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
        if self.expert_placement != "round-robin" and not self.expert_placement.startswith("popularity:"):
            raise ValueError(f"--expert-placement {self.expert_placement!r} is not one of "
                             f"{', '.join(EXPERT_PLACEMENTS)}")
        if self.expert_placement != "round-robin" and self.gpus == 1:
            raise ValueError("--expert-placement places experts on several GPUs: it needs --gpus N > 1")
        if self.gpus > 1 and self.kv_host_size:
            raise ValueError("--kv-host-size needs --gpus 1: the host KV tier moves pages of rank 0's KV pool only, "
                             "and every rank keeps its own")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be at least 1, got {self.page_size}")
