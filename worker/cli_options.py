"""Engine options shared by ``scripts/generate.py`` and the scheduler process."""
from __future__ import annotations

import argparse

from moe_offload.fp8 import EXPERT_DTYPES
from moe_offload.offloaded import LENT_SLOT_RULES
from worker.attention import BACKENDS
from worker.expert_placement import ExpertOptions
from worker.routing_options import RoutingOptions
from worker.runner import RunnerConfig


def add_runner_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or a geometry name such as qwen3-30b-geometry; "
                        "None: the embedded default model")
    p.add_argument("--device", default=RunnerConfig.device, help="cuda, cpu or auto")
    p.add_argument("--dtype", default=RunnerConfig.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=RunnerConfig.page_size, help="tokens per KV page")
    p.add_argument("--kv-tokens", type=int, default=RunnerConfig.kv_tokens,
                   help="KV pool size in tokens (0: from free memory on GPU, 16384 on CPU)")
    p.add_argument("--attention", default=RunnerConfig.attention, choices=["auto", *sorted(BACKENDS)],
                   help="attention backend; auto: triton on cuda (paged kernels), torch on cpu")
    p.add_argument("--max-prefill-tokens", type=int, default=RunnerConfig.max_prefill_tokens,
                   help="prompt tokens per prefill chunk; 0: auto, the largest multiple of 1024 up to "
                        "32768 whose activations fit in the GPU memory left after weights, expert cache and KV pool "
                        "(2048 on CPU). Under expert offload a chunk takes about as long at any size (it streams "
                        "every expert once), so bigger chunks prefill more tokens/s")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--moe-cache-size", type=int, default=None, help="expert cache slots (offload)")
    cache.add_argument("--moe-cache-fraction", type=float, default=None, help="expert cache as a fraction of experts")
    cache.add_argument("--moe-cache-auto", action="store_true",
                       help="expert cache fills the GPU memory left after weights, activations and the KV floor")
    p.add_argument("--moe-policy", default=ExpertOptions.policy, choices=["lru", "lfru"], help="cache eviction policy")
    p.add_argument("--kv-reserve-tokens", type=int, default=ExpertOptions.kv_reserve_tokens,
                   help="KV tokens --moe-cache-auto leaves room for")
    p.add_argument("--no-prefill-pipeline", dest="prefill_pipeline", action="store_false",
                   help="run prefill chunks through the expert cache instead of streaming each layer's experts "
                        "into a double buffer overlapped with compute (the pipeline is on: %(default)s)")
    p.add_argument("--prefill-invalidate", default=ExpertOptions.prefill_invalidate, choices=["fixed", "eager"],
                   help="how the pipeline empties its lent cache slots: fixed (one fixed-shape launch) or eager "
                        "(boolean-mask indexing, a hidden device->host sync per layer; for A/B measurements only)")
    p.add_argument("--prefill-stage", default=ExpertOptions.prefill_stage, choices=["auto", "kernel", "memcpy"],
                   help="how the pipeline fills its buffer: kernel (experts cached elsewhere copied on the GPU, "
                        "the rest read over PCIe by a kernel that holds some SMs), memcpy (whole layers by the copy "
                        "engine, no SMs), auto (per chunk, memcpy when the chunk's compute is long enough "
                        "that the SMs matter more than the PCIe bytes saved)")
    p.add_argument("--expert-dtype", default=ExpertOptions.expert_dtype, choices=EXPERT_DTYPES,
                   help="expert weights' format: auto (default) keeps the checkpoint's, fp8 runs e4m3 experts with "
                        "128x128 block scales (a bf16 checkpoint is quantized once, when the expert store is filled: "
                        "half the bytes over PCIe, twice the experts in the same cache memory), bf16 runs them in "
                        "the compute dtype")
    p.add_argument("--lent-slots", default=ExpertOptions.lent_slots, choices=list(LENT_SLOT_RULES),
                   help="what decode does with the 2E cache slots the prefill pipeline borrows: reserve (default: "
                        "decode never admits there, so they idle between prefills) or decode (decode admits there "
                        "too, as the first victims, and a prefill wipes only those coldest entries)")
    p.add_argument("--expert-prefetch", default="on" if ExpertOptions.prefetch else "off", choices=["on", "off"],
                   help="under expert offload, guess each next layer's experts at decode (its router applied to "
                        "this layer's hidden state) and copy the guessed misses over PCIe while this layer computes; "
                        "a wrong guess costs bytes, never a result (default: %(default)s)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs "
                        "(graphs are on: %(default)s)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=RunnerConfig.cuda_graph_max_batch,
                   help="largest decode batch replayed from a CUDA graph; larger ones run eagerly")
    p.add_argument("--gpu-memory-limit", type=float, default=RunnerConfig.gpu_memory_limit, metavar="GiB",
                   help="size the expert cache (--moe-cache-auto too), KV pool and prefill chunk as if the GPU had "
                        "this much memory, and cap torch's allocator there (e.g. 32 to run as on a 32 GB card)")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs to run on by expert parallelism (expert e on GPU e %% N, attention replicated): "
                        "this process drives rank 0 and starts one process per other GPU; on CPU, N gloo ranks")
    p.add_argument("--dummy-weights", action="store_true",
                   help="seeded random weights, experts written straight into the expert store (benchmarks)")
    p.add_argument("--seed-weights", type=int, default=ExpertOptions.seed, help="seed of --dummy-weights")
    add_routing_args(p)


def add_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", default=RoutingOptions.routing, metavar="model|synthetic|replay:FILE",
                   help="which experts each token goes to: model (default: the model's own router); synthetic "
                        "(with --dummy-weights: a router calibrated to Qwen3-30B-A3B's decode statistics, ~45%% of "
                        "choices repeat at the next token, ~80%% within 8, near-flat popularity); replay:FILE (a "
                        "trace written by --record-routing; tokens it lacks use the model's router)")
    p.add_argument("--record-routing", default=None, metavar="FILE",
                   help="record every token's routing (ids and weights per layer) on the device and write it to "
                        "FILE at exit, for --routing replay:FILE and scripts/cache_policy_report.py")
    p.add_argument("--record-routing-tokens", type=int, default=RoutingOptions.record_tokens,
                   help="tokens --record-routing holds (device buffers sized up front; later ones are dropped "
                        "with a warning)")


def runner_config(args: argparse.Namespace, model_dir: str) -> RunnerConfig:
    experts = ExpertOptions(args.moe_cache_size, args.moe_cache_fraction, args.moe_cache_auto, args.moe_policy,
                            args.kv_reserve_tokens, args.dummy_weights, args.seed_weights,
                            prefill_pipeline=args.prefill_pipeline, prefill_invalidate=args.prefill_invalidate,
                            prefill_stage=args.prefill_stage, expert_dtype=args.expert_dtype,
                            lent_slots=args.lent_slots, prefetch=args.expert_prefetch == "on")
    return RunnerConfig(model_dir, device=args.device, dtype=args.dtype, page_size=args.page_size,
                        kv_tokens=args.kv_tokens, attention=args.attention, experts=experts,
                        max_prefill_tokens=args.max_prefill_tokens, cuda_graph=args.cuda_graph,
                        cuda_graph_max_batch=args.cuda_graph_max_batch, gpu_memory_limit=args.gpu_memory_limit,
                        routing=routing_options(args))


def routing_options(args: argparse.Namespace) -> RoutingOptions:
    return RoutingOptions(args.routing, args.record_routing, args.record_routing_tokens, seed=args.seed_weights)


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from worker.default_model import default_model_dir

    return str(default_model_dir())
