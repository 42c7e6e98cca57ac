"""The engine's command-line flags: one per EngineArgs field (booleans get --x/--no-x),
with its help text, type and choices, and the deprecated start-up aliases."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from xlm.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, STARTUP_PROGRAMS
from xlm.models.pooling_config import CONVERTS

HELP = {
    "model": "model directory, .gguf file, built-in name (smollm2-135m) or Hugging Face "
    "name (org/name: the local hub cache first, downloaded unless HF_HUB_OFFLINE=1)",
    "revision": "branch, tag or commit of a Hugging Face model (default: main)",
    "download_dir": "Hugging Face cache directory to read and download into "
    "(default: HF_HUB_CACHE or HF_HOME/hub)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "weights and activations dtype; auto = float32 on CPU, else the checkpoint's",
    "max_model_len": "context length (default: the model's)",
    "seed": "seed of the engine's random state",
    "load_format": "weights format: auto, safetensors, gguf or dummy (random weights); for a "
    "Hugging Face name only these files are fetched (auto: safetensors)",
    "quantization": "weight quantization: int8 (int8 weights per output channel), w8a8 (and "
    "int8 activations per token), fp8 (float8 e4m3 weights), int4 (4-bit weights packed two "
    "per byte, a scale and minimum per group of 128 inputs), quantized as loaded; or gguf "
    "(a GGUF file's own block quants kept: Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) "
    "(default: float weights, or a compressed-tensors checkpoint's own int8/w8a8/fp8)",
    "served_model_name": "model name in the API (default: the model argument)",
    "limit_mm_per_prompt": "most multimodal items per prompt, as JSON: '{\"image\": 4}' "
    "(default: 16 images)",
    "allowed_local_media_path": "directory under which file:// image URLs may be read "
    "(default: none; file:// URLs are refused)",
    "allowed_media_domains": "comma-separated hosts whose http(s) image URLs the server "
    "fetches (default: none; remote URLs are refused)",
    "max_image_pixels": "most pixels (width x height) of one input image (default: 64 Mpx)",
    "mm_processor_kwargs": "options of the model's image processor over its "
    "preprocessor_config.json, a JSON object; Qwen2-VL / Qwen2.5-VL: min_pixels, max_pixels "
    "(or size: shortest_edge, longest_edge), e.g. '{\"max_pixels\": 1003520}'; without "
    "max_pixels, images are capped to min(max_num_batched_tokens, max_model_len) tokens "
    "(docs/multimodal.md)",
    "generation_config": "'auto' (use generation_config.json defaults), 'xlm' or a directory",
    "runner": "generate (text), pooling (embeddings: one vector per input), or auto (pooling "
    "when the checkpoint is an embedder: sentence-transformers files or a *Model "
    "architecture)",
    "convert": "what the pooling runner makes of the model: embed (vectors), classify (label "
    "scores from a score head: *ForSequenceClassification checkpoints, or a causal LM whose "
    "checkpoint has a score.weight; serves /classify, /score, /rerank), or auto (classify "
    "for *ForSequenceClassification, else embed); embed and classify imply --runner pooling",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "KV cache size in GiB on CPU (default: XLM_CPU_KVCACHE_SPACE or 1)",
    "memory_utilization": "fraction of accelerator memory xlm may use",
    "kv_offloading_size": "host KV tier in GiB of host memory per process: full blocks "
    "evicted from the device KV cache are kept there by block hash and copied back on a "
    "prefix hit instead of recomputed (0: off)",
    "kv_events_config": "publish prefix cache block events (BlockStored, BlockRemoved, "
    "AllBlocksCleared) for a router, a JSON object: enable_kv_cache_events, publisher (zmq), "
    "endpoint (tcp://...), topic",
    "kv_cache_dtype": "KV cache element type: auto (the model's dtype), float32, bfloat16, "
    "float16, fp8 (= fp8_e4m3), fp8_e5m2 or int8; fp8 halves bfloat16's cache bytes (more KV "
    "tokens in the same memory), values saturating at the type's largest; int8 stores each "
    "(token, KV head) row as int8 codes with one float32 scale (max|row| / 127), "
    "head_dim + 4 bytes",
    "enable_prefix_caching": "reuse cached KV blocks of shared prompt prefixes",
    "num_gpu_blocks_override": "fixed number of KV cache blocks (tests, benchmarks)",
    "max_num_batched_tokens": "token budget of one step",
    "max_num_seqs": "maximum number of requests in one step",
    "enable_chunked_prefill": "split long prompts across steps",
    "long_prefill_token_threshold": "chunk prefills longer than this (0: off)",
    "scheduling_policy": "fcfs or priority",
    "async_scheduling": "schedule step N+1 and process step N-1's outputs while step N "
    "runs; the sampled tokens feed the next step on the device",
    "tensor_parallel_size": "devices to shard the model over (env XLM_TENSOR_PARALLEL_SIZE)",
    "data_parallel_size": "engine cores behind one front end, each its own process on its "
    "own group of tensor_parallel_size devices; requests go to the least loaded rank or the "
    "one holding their prompt's first block in its prefix cache",
    "data_parallel_size_local": "data-parallel ranks on this host (default: all of them); "
    "fewer: the others run on other hosts (xlm serve --headless there)",
    "data_parallel_start_rank": "the first data-parallel rank this host runs (0 on the API "
    "server's host; --headless hosts: their first rank)",
    "data_parallel_address": "the API server host's address, where ranks on other hosts "
    "register (needed with --data-parallel-size-local below --data-parallel-size)",
    "data_parallel_rpc_port": "the port the API server listens on for ranks on other hosts "
    "(0 on the API server: any free port, logged)",
    "distributed_executor_backend": "uni (this process, all local devices) or multihost "
    "(jax.distributed, one process per host) (env XLM_DISTRIBUTED_EXECUTOR_BACKEND)",
    "coordinator_address": "multihost: host:port of process 0's jax.distributed coordinator "
    "(env XLM_COORDINATOR_ADDRESS, else the pod's: LWS_LEADER_ADDRESS, TPU_WORKER_HOSTNAMES)",
    "num_processes": "multihost: number of processes (env XLM_NUM_PROCESSES, else the pod's: "
    "LWS_GROUP_SIZE, TPU_WORKER_HOSTNAMES)",
    "process_id": "multihost: this process's id, 0 leads (env XLM_PROCESS_ID, else the pod's: "
    "LWS_WORKER_INDEX, TPU_WORKER_ID, JOB_COMPLETION_INDEX)",
    "custom_ops": "comma list: all, none, +name, -name",
    "token_buckets": "comma list of padded token counts per step",
    "startup_programs": "which step programs are ready before serving: all; largest (the "
    "largest token bucket's, the rest compiled in the background); first-use (the first "
    "step's, then the rest in the background); used (each when a step first needs it); "
    "None: largest for xlm serve and run-batch, first-use for LLM and xlm chat, used for "
    "xlm generate",
    "enable_compilation_cache": "save compiled step programs for the next start "
    "(XLM_COMPILATION_CACHE_DIR)",
    "reasoning_parser": "reasoning format (deepseek_r1, qwen3): splits reasoning_content "
    "out of chat replies; constraints apply after the reasoning",
    "target_topology": "compile for this TPU slice (v5e:2x2, v6e:2x4, v5p:2x2x1, v5e:4x4, ...) "
    "instead of running on the local devices; nothing is allocated or run",
    "structured_outputs_enable_in_reasoning": "apply structured-output constraints from the "
    "first token, reasoning included",
    "enable_lora": "serve LoRA adapters (PEFT directories) beside the base model: requests "
    "name one, each step mixes up to max_loras of them",
    "enable_sleep_mode": "allow sleep(level) / wake_up() (POST /sleep, /wake_up): level 1 "
    "moves the weights to host memory and drops the KV cache, level 2 drops both",
    "max_loras": "LoRA adapters on the device at once (slots; a step never mixes more)",
    "max_lora_rank": "largest adapter rank (every slot is padded to it)",
    "max_cpu_loras": "LoRA adapters kept read on the host (default: max_loras)",
    "speculative_config": "speculative decoding, a JSON object with method (ngram or "
    "draft_model), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max (ngram), "
    "model (draft_model: a smaller model with the same vocabulary), disable_by_batch_size "
    "and adaptive (false: always propose num_speculative_tokens); async scheduling is "
    "turned off with it",
}


# Options with no flag of their own in the engine CLIs: `xlm plan` adds target_topology's
# itself; the deprecated aliases of startup_programs get theirs from _add_deprecated_flags.
NO_FLAG = ("target_topology", "warmup", "compile_all_first")
CHOICES = {
    "distributed_executor_backend": ("uni", "multihost"),
    "quantization": QUANTIZATION_METHODS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "startup_programs": STARTUP_PROGRAMS,
    "convert": CONVERTS,
}


def add_deprecated_flags(group: Any, skip: tuple[str, ...]) -> None:
    """The old start-up flags, still accepted: EngineArgs maps them with a warning."""
    if "compile_all_first" not in skip:
        group.add_argument(
            "--compile-all-first",
            action="store_true",
            default=None,
            help="deprecated: --startup-programs all",
        )
    if "warmup" not in skip:
        group.add_argument(
            "--warmup",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="deprecated: --no-warmup is --startup-programs used",
        )


def add_engine_flags(group: Any, defaults: Any, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of `defaults` (an EngineArgs) to the argparse `group`."""
    for f in dataclasses.fields(defaults):
        if f.name in skip or f.name in NO_FLAG:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = (flag, "-tp") if f.name == "tensor_parallel_size" else (flag,)
        default = getattr(defaults, f.name)
        help_text = f"{HELP.get(f.name, '')} (default: {default})"
        if isinstance(default, bool):
            group.add_argument(
                flag, default=default, help=help_text, action=argparse.BooleanOptionalAction
            )
        elif f.name == "limit_mm_per_prompt":
            group.add_argument(flag, default=default, help=help_text, type=json.loads)
        elif f.name in ("custom_ops", "allowed_media_domains"):
            group.add_argument(
                flag,
                default=default,
                help=help_text,
                type=lambda s: [x for x in s.split(",") if x],
            )
        elif f.name == "token_buckets":
            group.add_argument(
                flag,
                default=default,
                help=help_text,
                type=lambda s: [int(x) for x in s.split(",") if x],
            )
        else:
            kind = {int: int, float: float}.get(type(default), None)
            if f.name in (
                "max_model_len",
                "num_gpu_blocks_override",
                "num_processes",
                "max_cpu_loras",
                "data_parallel_size_local",
                "data_parallel_rpc_port",
                "max_image_pixels",
            ):
                kind = int
            elif f.name == "process_id":
                kind = int
            elif f.name == "kv_cache_memory":
                kind = float
            choices = CHOICES.get(f.name)
            group.add_argument(
                *flags, default=default, help=help_text, type=kind or str, choices=choices
            )

    add_deprecated_flags(group, skip)
