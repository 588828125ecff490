"""The runner's command-line options, shared by ``scripts/generate.py``, the scheduler
process and the benchmarks: three groups (model, memory, offload) whose defaults are read from the
config classes (``worker.runner_config``) and whose choices come from the modules' own names.
Torch is not imported here, so ``--help`` answers at once.

Each option's ``dest`` is the name of the field it sets, and ``runner_config`` builds the frozen
``RunnerConfig`` from them; nothing is resolved here (sizes are the memory plan's)."""
from __future__ import annotations

import argparse
from dataclasses import fields, is_dataclass

from moe_offload.choices import EXPERT_DTYPES, FILL_MODES, INVALIDATE_MODES, LENT_SLOT_RULES, POLICIES, STAGE_MODES
from worker.routing_options import RoutingOptions
from worker.runner_config import (ATTENTION_BACKENDS, DTYPES, EXPERT_PLACEMENTS, KV_CACHE_DTYPES, ExpertOptions,
                                  RunnerConfig)

R, X = RunnerConfig, ExpertOptions


def add_runner_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p.add_argument_group("model", "what runs, on which device, and how decode steps launch"))
    _add_memory_args(p.add_argument_group(
        "memory", "the memory plan's inputs: sizes left at 0 or None are planned from the GPU memory free once "
                  "the weights are loaded (and the host RAM available), once at start-up, and logged as a table"))
    offload = p.add_argument_group("offload", "experts in pinned host memory behind a GPU expert cache "
                                              "(on with a --moe-cache-* option or --dummy-weights)")
    _add_offload_args(offload)
    _add_routing_args(offload)


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", default=None, metavar="DIR",
                   help="checkpoint directory or a geometry name such as qwen3-30b-geometry; None: the embedded "
                        "default model")
    g.add_argument("--device", default=R.device, help="cuda, cpu or auto")
    g.add_argument("--dtype", default=R.dtype, choices=DTYPES, help="compute dtype; auto: bfloat16 on cuda")
    g.add_argument("--page-size", type=int, default=R.page_size, metavar="TOKENS", help="tokens per KV page")
    g.add_argument("--attention", default=R.attention, choices=["auto", *ATTENTION_BACKENDS],
                   help="attention backend; auto: triton on cuda (paged kernels), torch on cpu")
    g.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs (graphs are on: "
                        "%(default)s)")
    g.add_argument("--cuda-graph-max-batch", type=int, default=R.cuda_graph_max_batch, metavar="N",
                   help="largest decode batch replayed from a CUDA graph; larger ones run eagerly")
    g.add_argument("--gpus", type=int, default=R.gpus, metavar="N",
                   help="GPUs to run on by expert parallelism (expert e on GPU e %% N unless --expert-placement "
                        "says otherwise, attention replicated): "
                        "this process drives rank 0 and starts one process per other GPU; on CPU, N gloo ranks")
    g.add_argument("--expert-placement", default=R.expert_placement, metavar="|".join(EXPERT_PLACEMENTS),
                   help="which GPU runs which expert with --gpus N: round-robin by id, or each layer's experts "
                        "balanced over the GPUs by their routed counts in a --record-routing FILE of this model (E/N "
                        "experts a GPU; needs --no-prefill-pipeline with an expert cache) (default: %(default)s)")
    g.add_argument("--dummy-weights", action="store_true",
                   help="seeded random weights, experts written straight into the expert store (benchmarks)")
    g.add_argument("--seed-weights", type=int, default=X.seed, metavar="SEED",
                   help="seed of --dummy-weights and --routing synthetic")


def _add_memory_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--gpu-memory-limit", type=float, default=R.gpu_memory_limit, metavar="GiB",
                   help="plan as if the GPU had this much memory, and cap torch's allocator there (e.g. 32 to "
                        "run as on a 32 GB card); None: the whole card")
    g.add_argument("--moe-cache-size", dest="cache_size", type=int, default=X.cache_size, metavar="SLOTS",
                   help="expert cache slots (one of --moe-cache-size, -fraction, -auto)")
    g.add_argument("--moe-cache-fraction", dest="cache_fraction", type=float, default=X.cache_fraction,
                   metavar="F",
                   help="expert cache as a fraction of all experts")
    g.add_argument("--moe-cache-auto", dest="cache_auto", action="store_true",
                   help="expert cache fills the GPU memory left after weights, a prefill chunk's activations and "
                        "the --kv-reserve-tokens floor")
    g.add_argument("--kv-reserve-tokens", type=int, default=X.kv_reserve_tokens, metavar="TOKENS",
                   help="KV tokens --moe-cache-auto leaves room for")
    g.add_argument("--kv-tokens", type=int, default=R.kv_tokens, metavar="TOKENS",
                   help="KV pool size in tokens; 0: 80%% of the GPU memory the expert cache left, less a prefill "
                        "chunk's activations (16384 on CPU)")
    g.add_argument("--kv-cache-dtype", default=R.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="what the KV pool and the host KV tier hold: auto, the compute dtype; fp8, float8 e4m3 with "
                        "no scale (values saturate at +-448), half the bytes a token, so twice the tokens, or a "
                        "bigger expert cache under --moe-cache-auto, and half the bytes a decode step reads. It "
                        "changes the numbers: see scripts/quant_quality.py --kv-fp8")
    g.add_argument("--max-prefill-tokens", type=int, default=R.max_prefill_tokens, metavar="TOKENS",
                   help="prompt tokens per prefill chunk; 0: the largest multiple of 1024 up to 32768 whose "
                        "activations fit in what the cache and the KV pool left (2048 on CPU). Under expert offload "
                        "a chunk takes about as long at any size (it streams every expert once), so bigger chunks "
                        "prefill more tokens/s")
    g.add_argument("--state-snapshots", type=int, default=R.state_snapshots, metavar="N",
                   help="hybrid models: GPU slots for the prefix cache's snapshots of the linear layers' state; 0: "
                        "twice --max-running, within 10%% of the free GPU memory (a quarter of the host KV tier "
                        "holds those evicted)")
    g.add_argument("--kv-host-size", type=float, default=R.kv_host_size, metavar="GiB",
                   help="host-RAM KV tier (see 'KV tier'); 0 disables it; None: 25%% of the host RAM available "
                        "once the model is loaded (on GPU; 0 on CPU)")


def _add_offload_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--moe-policy", dest="policy", default=X.policy, choices=POLICIES, help="cache eviction policy")
    g.add_argument("--no-prefill-pipeline", dest="prefill_pipeline", action="store_false",
                   help="run prefill chunks through the expert cache instead of streaming each layer's experts "
                        "into a double buffer overlapped with compute (the pipeline is on: %(default)s)")
    g.add_argument("--prefill-invalidate", default=X.prefill_invalidate, choices=INVALIDATE_MODES,
                   help="how the pipeline empties its lent cache slots: fixed (one fixed-shape launch) or eager "
                        "(boolean-mask indexing, a hidden device->host sync per layer; for A/B measurements only)")
    g.add_argument("--prefill-stage", default=X.prefill_stage, choices=STAGE_MODES,
                   help="how the pipeline fills its buffer: kernel (experts cached elsewhere copied on the GPU, "
                        "the rest read over PCIe by a kernel that holds some SMs), memcpy (whole layers by the copy "
                        "engine, no SMs), mirror (the misses alone by the copy engine, planned from the host's "
                        "copy of the cache table, cached experts read in place), misses (the same planned on the "
                        "device: needs CUDA-graph conditional nodes), auto (per chunk, mirror when the chunk's "
                        "compute is long enough that the SMs matter more than the copy engine's calls, else kernel)")
    g.add_argument("--expert-dtype", default=X.expert_dtype, choices=EXPERT_DTYPES,
                   help="expert weights' format: auto keeps the checkpoint's, fp8 runs e4m3 experts with "
                        "128x128 block scales (a bf16 checkpoint is quantized once, when the expert store is filled: "
                        "half the bytes over PCIe, twice the experts in the same cache memory), bf16 runs them in "
                        "the compute dtype")
    g.add_argument("--lent-slots", default=X.lent_slots, choices=LENT_SLOT_RULES,
                   help="what decode does with the 2E cache slots the prefill pipeline borrows: reserve (decode "
                        "never admits there, so they idle between prefills) or decode (decode admits there "
                        "too, as the first victims, and a prefill wipes only those coldest entries)")
    g.add_argument("--expert-prefetch", dest="prefetch", type=_on_off, default=X.prefetch, metavar="on|off",
                   help="under expert offload, guess each next layer's experts at decode (its router applied to "
                        "this layer's hidden state) and copy the guessed misses over PCIe while this layer computes; "
                        "a wrong guess costs bytes, never a result")
    g.add_argument("--expert-prefetch-cap", dest="prefetch_cap", type=int, default=X.prefetch_cap, metavar="N",
                   help="with --expert-prefetch on, copy at most N guessed experts a layer, the most likely first, so "
                        "the guess crosses PCIe while the layer before computes (0: every guessed miss that fits)")
    g.add_argument("--expert-fill", dest="fill", default=X.fill, choices=FILL_MODES,
                   help="how decode copies an expert-cache miss into its slot: gemm (the expert GEMM reads it "
                        "from host memory and stores it into the slot as it computes, beside the hits; fp8 "
                        "experts are gathered) or gather (a copy launch before the GEMM)")


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r} is not on or off")
    return text == "on"


def _add_routing_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--routing", default=RoutingOptions.routing, metavar="model|synthetic|replay:FILE",
                   help="which experts each token goes to: model (the model's own router); synthetic "
                        "(with --dummy-weights: a router calibrated to Qwen3-30B-A3B's decode statistics, ~45%% of "
                        "choices repeat at the next token, ~80%% within 8, near-flat popularity); replay:FILE (a "
                        "trace written by --record-routing; tokens it lacks use the model's router)")
    g.add_argument("--record-routing", dest="record", default=RoutingOptions.record, metavar="FILE",
                   help="record every token's routing (ids and weights per layer) on the device and write it to "
                        "FILE at exit, for --routing replay:FILE and scripts/cache_policy_report.py")
    g.add_argument("--record-routing-tokens", dest="record_tokens", type=int, default=RoutingOptions.record_tokens,
                   metavar="TOKENS",
                   help="tokens --record-routing holds (device buffers sized up front; later ones are dropped "
                        "with a warning)")


def runner_config(args: argparse.Namespace, model_dir: str) -> RunnerConfig:
    """The ``RunnerConfig`` of parsed ``args`` (ValueError: options that cannot go together)."""
    seed = args.seed_weights
    return RunnerConfig(model_dir, experts=ExpertOptions(**config_fields(args, ExpertOptions), seed=seed),
                        routing=RoutingOptions(**config_fields(args, RoutingOptions), seed=seed),
                        **config_fields(args, RunnerConfig))


def config_fields(args: argparse.Namespace, cls: type) -> dict:
    """The fields of the dataclass ``cls`` that ``args`` sets (the options' dests are the fields'
    names; nested configs and seeds are set by the caller)."""
    return {f.name: getattr(args, f.name) for f in fields(cls)
            if f.name not in ("model_dir", "seed") and not is_dataclass(f.default) and hasattr(args, f.name)}


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from worker.default_model import default_model_dir  # builds the default model on first use (torch)

    return str(default_model_dir())
