"""The memory plan: how the GPU memory free once the weights are loaded (under ``--gpu-memory-limit``
when given) and the host RAM available are split. One function makes it, once, at start-up, before
any of it is allocated; the runner sizes the expert cache and the KV pool from it, the engine its
prefill chunk and host KV tier, and it is logged as a table.

```
 GPU free after weights | expert cache         | KV pool               | prefill chunk's activations | rest
                        | --moe-cache-size,    | --kv-tokens, else 80% | --max-prefill-tokens, else  |
                        | -fraction, or -auto: | of what the cache     | the largest multiple of     |
                        | all but a chunk's    | left, never a chunk's | 1024 tokens up to 32768     |
                        | activations and the  | activations           | that fits (reusing what the |
                        | --kv-reserve-tokens  |                       | allocator holds unused)     |
                        | floor                |                       |                             |
 host RAM available     | host KV tier: --kv-host-size, else 25%                                     | rest
```

gpt-oss's sliding layers keep their KV in a window pool of their own, sized before the split: a
ring of window pages per running request and per cached window, plus a prefill chunk's pages
(``window_pool_tokens``); the KV pool then counts full layers only, at the whole sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from worker.attention.cudnn_prefill import HEAD_DIMS, piece_lengths
from worker.config import ModelConfig
from worker.runner_config import ExpertOptions, RunnerConfig

GIB = 1 << 30
AUTO_PREFILL_STEP = 1024  # --max-prefill-tokens 0 on a GPU: a multiple of this ...
AUTO_PREFILL_MAX = 32768  # ... up to this
AUTO_PREFILL_RESERVE = 8192  # the chunk the cache and the KV pool leave activations for while the size is auto
CPU_PREFILL_TOKENS = 2048
CPU_KV_TOKENS = 16384
MAX_KV_TOKENS = 1 << 20
KV_SHARE = 0.8  # of the GPU memory the expert cache left
HOST_KV_SHARE = 0.25  # of the host RAM available, for --kv-host-size's default on a GPU
ACTIVATION_SLACK = 1 << 30  # allocator blocks, kernels' workspaces, small tables


class PlanInputs(NamedTuple):
    """What the plan is made from, measured once the weights are loaded and the expert store open."""

    gpu_free: int | None  # bytes free for the engine (under --gpu-memory-limit); None: a CPU runner
    gpu_reusable: int  # bytes torch's allocator holds unused: a chunk's activations reuse them first
    host_available: int  # host RAM available (MemAvailable)
    slot_bytes: int  # one expert in its format: what a cache slot holds
    kv_token_bytes: int  # K and V of one token in every layer of the KV pool (full attention)
    torch_attention: bool  # the torch reference attention: its [q, k] mask counts among the activations
    window_token_bytes: int = 0  # K and V of one token in every sliding layer (gpt-oss; 0: none)


@dataclass(frozen=True)
class MemoryPlan:
    expert_slots: int  # GPU expert cache slots; every expert when none is offloaded
    kv_pages: int  # GPU KV pool pages, the scratch page included
    prefill_tokens: int  # prompt tokens per prefill chunk
    host_kv_bytes: int  # host KV tier (0: none)
    page_size: int
    gpu_free: int | None  # what was split (None: a CPU runner)
    expert_bytes: int  # of the cache (0 when the experts were loaded with the weights)
    kv_bytes: int
    activation_bytes: int  # of a prefill chunk of prefill_tokens
    # hybrid models: the recurrent-state pool, allocated before the split (running slots + snapshots)
    state_bytes: int = 0
    state_slots: tuple[int, int] = (0, 0)
    # gpt-oss: the sliding layers' window pool, the scratch page included (0: none)
    window_pages: int = 0
    window_bytes: int = 0
    kv_cache_dtype: str = "auto"  # RunnerConfig.kv_cache_dtype: what the pools hold

    def table(self, total_experts: int, experts: str = "experts") -> str:
        """The plan as the start-up log shows it (``experts``: what the slots hold, e.g. "bf16 experts")."""
        free = "CPU" if self.gpu_free is None else f"{_gib(self.gpu_free).strip()} GPU free"
        rows = [f"memory plan ({free}):",
                f"  expert cache   {_gib(self.expert_bytes)}  {self.expert_slots} of {total_experts} {experts}",
                f"  KV pool        {_gib(self.kv_bytes)}  {self.kv_pages} pages of {self.page_size} tokens"
                f"{' in float8 e4m3' if self.kv_cache_dtype == 'fp8' else ''}",
                f"  prefill chunk  {_gib(self.activation_bytes)}  {self.prefill_tokens} tokens (activations)",
                f"  host KV tier   {_gib(self.host_kv_bytes)}"]
        if self.window_bytes:
            rows.insert(3, f"  window pool    {_gib(self.window_bytes)}  {self.window_pages} pages of {self.page_size} "
                           f"tokens for the sliding layers' windows")
        if self.state_bytes:
            running, snapshots = self.state_slots
            rows.insert(3, f"  state pool     {_gib(self.state_bytes)}  {running} running + {snapshots} snapshot "
                           f"slots of linear-attention state")
        return "\n".join(rows)


def plan_memory(inputs: PlanInputs, model: ModelConfig, config: RunnerConfig) -> MemoryPlan:
    """Split ``inputs``' memory for ``model`` under ``config``'s options; ValueError when the options
    cannot fit (an expert cache smaller than one layer's experts)."""
    reserve = activation_bytes(model, config.max_prefill_tokens or AUTO_PREFILL_RESERVE, model.max_context,
                               inputs.torch_attention, config.state_slots, config.kv_cache_dtype == "fp8")
    window_pages = 1 + window_pool_tokens(model, config, inputs.gpu_free is not None) // config.page_size
    window = window_pages * config.page_size * inputs.window_token_bytes if inputs.window_token_bytes else 0
    slots = _checked_slots(inputs, model, config.experts, reserve + window)
    cache = slots * inputs.slot_bytes if config.experts.uses_store else 0
    pages = 1 + -(-_kv_tokens(inputs, config, cache + window, reserve) // config.page_size)
    kv = pages * config.page_size * inputs.kv_token_bytes
    context = min(model.max_context, (pages - 1) * config.page_size)
    tokens = _prefill_tokens(inputs, model, config, cache + kv + window, context)
    plan = MemoryPlan(slots, pages, tokens, _host_kv_bytes(inputs, config), config.page_size, inputs.gpu_free,
                      cache, kv, activation_bytes(model, tokens, context, inputs.torch_attention, config.state_slots,
                                                  config.kv_cache_dtype == "fp8"),
                      window_pages=window_pages if window else 0, window_bytes=window,
                      kv_cache_dtype=config.kv_cache_dtype)
    _check_fits(plan, model)
    return plan


def _check_fits(plan: MemoryPlan, model: ModelConfig) -> None:
    """Refuse what cannot be allocated (the activations are an estimate: a chunk that may not fit is
    the user's call, not refused)."""
    if plan.gpu_free is None:
        return
    if plan.expert_bytes + plan.kv_bytes + plan.window_bytes > plan.gpu_free or plan.kv_pages < 2:
        raise ValueError(f"the expert cache and the KV pool do not fit in the GPU memory free once the weights "
                         f"are loaded (give a smaller --moe-cache-*, --max-prefill-tokens or --kv-tokens):\n"
                         f"{plan.table(model.num_layers * model.num_experts)}")


def window_ring_pages(window: int, page_size: int) -> int:
    """Window pages a sequence holds between steps: its last ``window`` keys from the page
    boundary before its next token (where the prefix cache may keep them), that page, and one
    more (an overlapped step may run a token ahead of the tokens the host has read)."""
    return -(-window // page_size) + 2


def window_pool_tokens(model: ModelConfig, config: RunnerConfig, on_gpu: bool) -> int:
    """The window pool's tokens (gpt-oss's sliding layers): a ring per running request
    (``state_slots``, the scheduler's --max-running) and as many for the prefix cache's windows,
    plus the pages of a prefill chunk of the largest size the plan may pick and a page per request
    a chunk may start inside; 0 without sliding layers."""
    if not model.sliding_window or not any(model.window(i) for i in range(model.num_layers)):
        return 0
    chunk = config.max_prefill_tokens or (AUTO_PREFILL_MAX if on_gpu else CPU_PREFILL_TOKENS)
    rings = 2 * config.state_slots * window_ring_pages(model.sliding_window, config.page_size)
    return (rings + config.state_slots + -(-chunk // config.page_size)) * config.page_size


def activation_bytes(model: ModelConfig, tokens: int, context: int, torch_attention: bool, rows: int,
                     kv_fp8: bool = False) -> int:
    """A generous estimate of a prefill chunk's transient memory: per-token activations, the
    logits of its ``rows`` sequences at most (the lm_head runs on each row's last token only), one
    layer's K and V of ``context`` keys gathered from the pages, its parts' outputs stacked and the
    one being computed (the cuDNN prefill path; the paged kernel reads the pages in place), and with
    the torch reference attention its [q, k] boolean mask plus the bf16 bias SDPA makes of it, for
    ``tokens`` attending over up to ``context`` keys."""
    per_token = model.top_k * (3 * model.expert_intermediate_size + 2 * model.hidden_size) + 8 * model.hidden_size
    logits = 4 * min(tokens, rows) * model.vocab_size  # float32, and the sampler's copies of them
    gathered = 2 * context * model.num_kv_heads * model.head_dim * 2  # bf16/fp16 only take that path
    if kv_fp8:  # a float8 pool's prefix is cast as it is gathered: V's float8 copy beside both bf16 ones
        gathered += gathered // 4
    cudnn = model.head_dim in HEAD_DIMS and not model.attention_sinks  # the layers that may take it
    parts = (len(piece_lengths(context)) + 2) * tokens * model.num_heads * model.head_dim * 2 if cudnn else 0
    mask = 3 * tokens * context if torch_attention else 0
    return 4 * (tokens * per_token + logits) + gathered + parts + mask + ACTIVATION_SLACK


def expert_slots(options: ExpertOptions, total: int, slot_bytes: int, auto_bytes: int | None) -> int:
    """Cache slots: ``--moe-cache-size``, ``-fraction`` of the ``total`` experts, or (``-auto``) as
    many as ``auto_bytes`` hold (None: no GPU to size from); every expert when none is given
    (resident, or ``--dummy-weights`` alone). Never more than there are experts."""
    if options.cache_size is not None:
        slots = options.cache_size
    elif options.cache_fraction is not None:
        slots = max(1, int(options.cache_fraction * total))
    elif options.cache_auto:
        if auto_bytes is None:
            raise ValueError("--moe-cache-auto sizes the cache from free GPU memory; give --moe-cache-size on CPU")
        slots = max(auto_bytes, 0) // slot_bytes
    else:
        slots = total
    return min(slots, total)


def _checked_slots(inputs: PlanInputs, model: ModelConfig, options: ExpertOptions, reserve: int) -> int:
    auto_bytes = None
    if inputs.gpu_free is not None:
        auto_bytes = inputs.gpu_free - reserve - options.kv_reserve_tokens * inputs.kv_token_bytes
    slots = expert_slots(options, model.num_layers * model.num_experts, inputs.slot_bytes, auto_bytes)
    if options.uses_store and slots < model.num_experts:
        raise ValueError(f"the expert cache would hold {slots} experts; it needs at least one layer's "
                         f"{model.num_experts} (a prefill chunk can route to all of them)")
    return slots


def _kv_tokens(inputs: PlanInputs, config: RunnerConfig, cache_bytes: int, reserve: int) -> int:
    if config.kv_tokens:
        return config.kv_tokens
    if inputs.gpu_free is None:
        return CPU_KV_TOKENS
    # never the activations' share: the cache left that for the prefill chunk, and a pool that took
    # it would shrink the chunk to the minimum
    free = inputs.gpu_free - cache_bytes
    usable = min(int(free * KV_SHARE), free - reserve)
    return min(max(usable, 0) // inputs.kv_token_bytes, MAX_KV_TOKENS)


def _prefill_tokens(inputs: PlanInputs, model: ModelConfig, config: RunnerConfig, planned: int,
                    context: int) -> int:
    """``--max-prefill-tokens``, else on a GPU the largest multiple of 1024 up to 32768 whose
    activations fit in what the cache and the KV pool left (at least 1024). Under expert offload a
    chunk costs about the same at any size (every expert streams once per chunk), so the biggest
    chunk that fits gives the most prefill tokens/s."""
    if config.max_prefill_tokens:
        return config.max_prefill_tokens
    if inputs.gpu_free is None:
        return CPU_PREFILL_TOKENS
    left = inputs.gpu_free - planned + inputs.gpu_reusable
    sizes = range(AUTO_PREFILL_MAX, AUTO_PREFILL_STEP - 1, -AUTO_PREFILL_STEP)
    fp8 = config.kv_cache_dtype == "fp8"
    return next((t for t in sizes if activation_bytes(model, t, context, inputs.torch_attention, config.state_slots,
                                                      fp8) <= left),
                AUTO_PREFILL_STEP)


def _host_kv_bytes(inputs: PlanInputs, config: RunnerConfig) -> int:
    if config.kv_host_size is not None:
        return int(config.kv_host_size * GIB)
    # on a CPU the KV pool already lives in host RAM: a second copy buys nothing; with several ranks
    # the tier would move rank 0's pages only
    return int(inputs.host_available * HOST_KV_SHARE) if inputs.gpu_free is not None and config.gpus == 1 else 0


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:9.2f} GiB"


def host_available_bytes() -> int:
    """The host RAM the kernel reports available now (0 where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0
    return int(info.get("MemAvailable", "0 kB").split()[0]) * 1024
