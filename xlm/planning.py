"""`xlm plan`: build the engine's worker for a compile target (a TPU slice, no TPU here),
compile the programs it would run there and report per-chip memory, compile times, the
Pallas kernel's presence and a roofline decode estimate.

The worker is the engine's own (xlm.worker.worker.Worker with `target_topology` set): the
same mesh rules, KV cache sizing and `program_specs()` as serving, over the slice's
abstract devices, with weights and caches as sharded ShapeDtypeStructs. Each program is
lowered and compiled by the TPU compiler; `memory_analysis()` gives its per-chip temp
bytes, `cost_analysis()` its per-chip flops and bytes. Speed is an estimate from those
figures and the chip's published peaks, never a measurement.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlm.config import XlmConfig
from xlm.distributed.mesh import per_device_bytes
from xlm.logger import init_logger
from xlm.multimodal.budget import tokens_per_image
from xlm.multimodal.processor_config import resolve_processor_config
from xlm.platforms.target import CompileTarget, compile_target
from xlm.quantization import SCHEMES
from xlm.worker.compilation import ProgramKey, ProgramKind, ProgramSpec
from xlm.worker.worker import KVCacheTooSmallError, Worker, kv_cache_bytes_per_block

logger = init_logger(__name__)

# The Pallas kernels' custom-call targets in compiled HLO: Mosaic (TPU) and Triton (GPU).
PALLAS_CALLS = ('custom_call_target="tpu_custom_call"', 'custom_call_target="__gpu$xla.gpu.triton"')


@dataclass
class CompiledProgram:
    """One compiled program's figures (per chip)."""

    key: ProgramKey
    compile_s: float
    pallas_kernel: bool
    flops: float
    bytes_accessed: float
    temp_bytes: int
    # "compiler": the compiled program's cost_analysis(); "count": xlm's own count where
    # the compiler gives none (XLA:GPU without a device).
    cost_source: str = "compiler"

    @property
    def name(self) -> str:
        return f"{self.key.kind.value}[{self.key.size}]"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.key.kind.value,
            "size": self.key.size,
            "compile_s": round(self.compile_s, 3),
            "pallas_kernel": self.pallas_kernel,
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "temp_bytes": self.temp_bytes,
            "cost_source": self.cost_source,
        }


class ProgramTooLargeError(ValueError):
    """The compiler refused a program: its temporaries exceed the chip's memory."""

    def __init__(self, key: ProgramKey, message: str) -> None:
        super().__init__(message)
        self.key = key
        match = re.search(r"HLO temporaries \(([\d.]+)G\)", message)
        self.temp_bytes = int(float(match.group(1)) * (1 << 30)) if match else None


def compile_program(
    key: ProgramKey, spec: ProgramSpec, count: Callable[[ProgramKey], tuple[float, float]]
) -> CompiledProgram:
    """Lower and compile one program for the target; read its cost and memory (`count`
    gives flops and bytes where the compiler reports no cost)."""
    start = time.perf_counter()
    try:
        compiled = spec.lower().compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ProgramTooLargeError(key, str(e).splitlines()[0]) from e
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    source = "compiler"
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    if not cost:
        source, (flops, accessed) = "count", count(key)
    text = compiled.as_text()
    return CompiledProgram(
        key=key,
        compile_s=seconds,
        pallas_kernel=any(call in text for call in PALLAS_CALLS),
        flops=flops,
        bytes_accessed=accessed,
        temp_bytes=int(getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0)),
        cost_source=source,
    )


PACKED_SCHEMES = frozenset(name for name, scheme in SCHEMES.items() if scheme.packed)


def weight_elements_per_device(model: nnx.Module) -> int:
    """The most weights any device multiplies per token: elements of every parameter, a
    packed int4 kernel's byte counting its two weights."""
    state = nnx.state(model)
    elements = per_device_bytes(state, elements=True)
    packed = [
        var.get_value()
        for _, var in nnx.to_flat_state(state)
        if var.get_metadata().get("quantized") in PACKED_SCHEMES
    ]
    for device, count in per_device_bytes(packed, elements=True).items():
        elements[device] += count
    return max(elements.values())


def counted_cost(worker: Worker) -> Callable[[ProgramKey], tuple[float, float]]:
    """xlm's own per-chip count of a program's flops and bytes: a model step reads every
    weight once and does 2 flops per weight per token; the sampler, pooler and prompt
    logprobs read and write their rows of float32 logits (hidden states) a few times."""
    weight_bytes = worker.weight_bytes_per_device()
    weights = weight_elements_per_device(worker.model)
    hf = worker.config.model_config.hf_config
    encoder_bytes = worker.encoder_weight_bytes_per_device()
    encoder_elements = worker.encoder_weight_bytes_per_device(elements=True)
    # An image-count bucket's images each bring tokens_per_image patches; a patch-count
    # bucket (Qwen2-VL's encoder_layout) counts its patches itself.
    by_patches = hasattr(worker.model, "encoder_layout")
    per_image = 1 if by_patches else tokens_per_image(hf, resolve_processor_config(worker.config))

    def count(key: ProgramKey) -> tuple[float, float]:
        if key.kind == ProgramKind.MODEL:
            return 2.0 * weights * key.size, float(weight_bytes)
        if key.kind == ProgramKind.ENCODER:  # each image's patches through every weight
            return 2.0 * encoder_elements * (per_image or 1) * key.size, float(encoder_bytes)
        width = hf.hidden_size if key.kind == ProgramKind.POOLER else hf.vocab_size
        return 8.0 * key.size * width, 4.0 * 4 * key.size * width

    return count


def choose_programs(
    specs: dict[ProgramKey, ProgramSpec], decode_keys: set[ProgramKey], every: bool
) -> list[ProgramKey]:
    """Every program (`every`), else per kind the smallest and largest, plus the decode
    programs the estimate reads."""
    if every:
        return list(specs)
    chosen: set[ProgramKey] = set(decode_keys)
    for kind in ProgramKind:
        keys = sorted((k for k in specs if k.kind == kind), key=lambda k: k.size)
        chosen.update(keys[:1] + keys[-1:])
    return [k for k in specs if k in chosen]


def decode_keys(worker: Worker, batch: int) -> list[ProgramKey]:
    """The programs of a decode step of `batch` requests (one token each)."""
    runner = worker.model_runner
    tokens = runner.buckets.token_bucket(batch)
    keys = [runner._key(ProgramKind.MODEL, tokens)]
    if runner.config.model_config.is_pooling:
        keys.append(runner._key(ProgramKind.POOLER, tokens))
    else:
        logit_rows = runner.buckets.logit_rows_for_tokens(tokens)
        rows = runner.buckets.sampler_rows(logit_rows, batch)
        keys.append(runner._key(ProgramKind.SAMPLER, rows))
    return keys


def decode_estimate(
    worker: Worker,
    target: CompileTarget,
    programs: dict[ProgramKey, CompiledProgram],
    batch: int,
    kv_tokens: int,
) -> dict[str, Any]:
    """Roofline of one decode step of `batch` requests on one chip: each program takes
    max(flops / peak, bytes / bandwidth), the bandwidth measured on such a chip where it
    was (Chip.bytes_per_s). The attention kernel is a custom call whose
    KV reads the compiler does not count, so they are added: every request at the longest
    context the KV cache holds for `batch` requests (at most max_model_len)."""
    chip = target.chip
    config = worker.config
    context = min(config.scheduler_config.max_model_len, kv_tokens // batch)
    kv_token_bytes = (
        kv_cache_bytes_per_block(worker.model, 1, worker.kv_dtype)
        // config.parallel_config.tensor_parallel_size
    )
    kv_read = batch * context * kv_token_bytes
    seconds = kv_read / chip.bytes_per_s
    for key in decode_keys(worker, batch):
        p = programs[key]
        seconds += max(p.flops / chip.peak_bf16_flops, p.bytes_accessed / chip.bytes_per_s)
    return {
        "batch": batch,
        "context_tokens": context,
        "kv_read_bytes": kv_read,
        "step_ms": seconds * 1e3,
        "tok_s": batch / seconds,
    }


def _sizes(worker: Worker) -> dict[str, int]:
    runner = worker.model_runner
    return {
        "weight_bytes": worker.weight_bytes_per_device(),
        "encoder_weight_bytes": worker.encoder_weight_bytes_per_device(),
        "encoder_cache_bytes": worker.encoder_cache_bytes(),
        "kv_cache_bytes": max(per_device_bytes(runner.kv_caches).values()),
        "kv_cache_tokens": worker.num_blocks * worker.config.cache_config.block_size,
    }


def host_kv_tier_plan(worker: Worker, target: CompileTarget) -> dict[str, Any] | None:
    """The host KV tier each host keeps (kv_offloading_size GiB of host memory, not HBM):
    its hosts' shards of a block and how many blocks fit; None when off."""
    config = worker.config
    size = config.cache_config.kv_offloading_size
    if size <= 0:
        return None
    block_size = config.cache_config.block_size
    tp = config.parallel_config.tensor_parallel_size
    full = kv_cache_bytes_per_block(worker.model, block_size, worker.kv_dtype)
    # A host keeps one copy of each distinct shard its chips hold.
    block_bytes = full * min(target.devices_per_host, tp) // tp
    blocks = int(size * (1 << 30) // block_bytes)
    return {
        "size_gib": size,
        "block_bytes_per_host": block_bytes,
        "blocks": blocks,
        "tokens": blocks * block_size,
    }


def _header(config: XlmConfig, target: CompileTarget) -> dict[str, Any]:
    """What was planned: the slice, its chip's figures and the engine's step shapes."""
    sched = config.scheduler_config
    return {
        "model": config.model_config.model,
        "topology": target.topology,
        "device_kind": target.device_kind,
        "chips": len(target.devices),
        "hosts": target.num_hosts,
        "chips_per_host": target.devices_per_host,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "chip": {
            "name": target.chip.name,
            "hbm_bytes": target.chip.hbm_bytes,
            "peak_bf16_flops": target.chip.peak_bf16_flops,
            "hbm_bytes_per_s": target.chip.hbm_bytes_per_s,
            "source": target.chip.source,
            "copy_bytes_per_s": target.chip.copy_bytes_per_s,
            "copy_source": target.chip.copy_source or None,
        },
        "memory_utilization": config.cache_config.memory_utilization,
        "max_model_len": sched.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
    }


@dataclass
class _Budget:
    """A chip's HBM and the share the engine may use."""

    hbm: int
    utilization: float

    @property
    def allowed(self) -> int:
        return int(self.hbm * self.utilization)

    def per_chip(self, sizes: dict[str, Any], temp: int | None, total: int | None) -> dict:
        short = None if total is None else max(total - self.allowed, 0)
        return {
            **sizes,
            "max_temp_bytes": temp,
            "total_bytes": total,
            "hbm_bytes": self.hbm,
            "budget_bytes": self.allowed,
            "shortfall_bytes": short,
        }

    def over(self, needs: str, total: int) -> str:
        return (
            f"{needs} need {total} bytes per chip; {self.allowed} allowed "
            f"({self.utilization} of {self.hbm}): {total - self.allowed} short"
        )


def _weights_do_not_fit(e: KVCacheTooSmallError, config: XlmConfig, budget: _Budget) -> dict:
    needed_kv = e.needed_blocks * e.block_bytes
    total = e.weight_bytes + needed_kv
    sizes = {
        "weight_bytes": e.weight_bytes,
        "kv_cache_bytes": 0,
        "kv_cache_tokens": 0,
        "kv_bytes_one_request": needed_kv,
    }
    needs = (
        f"weights ({e.weight_bytes}) and the KV cache of one max_model_len="
        f"{config.scheduler_config.max_model_len} request ({e.needed_blocks} blocks, "
        f"{needed_kv})"
    )
    return dict(
        fits=False,
        reason=budget.over(needs, total)
        + " (raise tensor_parallel_size, lower max_model_len, or choose a larger chip)",
        per_chip=budget.per_chip(sizes, None, total),
        programs=[],
        decode_estimate=None,
    )


def _cache_blocks(worker: Worker, weight_bytes: int, max_temp: int, budget: _Budget) -> int:
    """KV blocks the chip holds beside the weights, the encoder cache's pool and the largest
    program's temporaries (at least one request's: fewer do not fit, and the total then
    says by how much)."""
    block_bytes = max(per_device_bytes(worker.model_runner.kv_caches).values()) // worker.num_blocks
    taken = weight_bytes + worker.encoder_cache_bytes() + max_temp
    blocks = max(budget.allowed - taken, 0) // block_bytes
    return max(blocks, worker.blocks_for_one_request())


def _with_blocks(config: XlmConfig, num_blocks: int) -> Worker:
    """The plan's worker again, with a KV cache of `num_blocks` blocks."""
    cache = dataclasses.replace(config.cache_config, num_blocks=num_blocks)
    return Worker(config.replace(cache_config=cache))


def _compile_chosen(
    worker: Worker, every: bool, compiled: dict[ProgramKey, CompiledProgram] | None = None
) -> tuple[dict[ProgramKey, CompiledProgram], ProgramTooLargeError | None]:
    """Compile the programs `choose_programs` picks; stop at the first one refused.
    Programs that take no KV cache are taken from `compiled` where it has them (the cache's
    size changes only the model programs)."""
    specs = worker.model_runner.program_specs()
    max_seqs = worker.config.scheduler_config.max_num_seqs
    decode = {k for b in (1, max_seqs) for k in decode_keys(worker, b)}
    programs: dict[ProgramKey, CompiledProgram] = {}
    count = counted_cost(worker)
    for key in choose_programs(specs, decode, every):
        if key.kind != ProgramKind.MODEL and key in (compiled or {}):
            programs[key] = compiled[key]
            continue
        try:
            programs[key] = compile_program(key, specs[key], count)
        except ProgramTooLargeError as e:
            return programs, e
        logger.info("Compiled %s in %.1f s.", programs[key].name, programs[key].compile_s)
    return programs, None


def _grown_temps(
    small: dict[ProgramKey, CompiledProgram], final: dict[ProgramKey, CompiledProgram]
) -> list[str]:
    """Programs whose temporaries grew when the cache did (an in-place cache update needs
    none; a copy of the cache does)."""
    slack = 1 << 20
    return [
        f"{p.name}: {small[key].temp_bytes} -> {p.temp_bytes} bytes"
        for key, p in final.items()
        if key in small and p.temp_bytes > 1.05 * small[key].temp_bytes + slack
    ]


def _compile_sized(
    config: XlmConfig, worker: Worker, budget: _Budget, every: bool
) -> tuple[Worker, dict[ProgramKey, CompiledProgram], ProgramTooLargeError | None, list[str]]:
    """Compile with one request's cache, size the cache after the largest temporaries,
    compile again at that size: (final worker, programs, refusal, temporaries that grew)."""
    weight_bytes = worker.weight_bytes_per_device()
    worker = _with_blocks(config, worker.blocks_for_one_request())
    small, refused = _compile_chosen(worker, every)
    if refused is not None:
        return worker, small, refused, []
    max_temp = max(p.temp_bytes for p in small.values())
    worker = _with_blocks(config, _cache_blocks(worker, weight_bytes, max_temp, budget))
    programs, refused = _compile_chosen(worker, every, small)
    return worker, programs, refused, _grown_temps(small, programs)


def plan(config: XlmConfig, *, every: bool = False, data_parallel_size: int = 1) -> dict[str, Any]:
    """Build the worker for `config`'s target topology, compile its programs and report.

    With `data_parallel_size` N, the topology holds N replicas of tensor_parallel_size
    chips each (as `xlm serve --data-parallel-size N` places them); one replica is compiled
    and the report adds its figures (`per_replica`) and the N replicas' (`total`).

    With the cache sized automatically, the programs are first compiled with the smallest
    cache (one request's blocks): the cache is then what the budget leaves after the
    weights and the largest program's temporaries, and the programs are compiled again
    at that size to check that their temporaries did not grow with it.

    Call under `xlm.platforms.target.compiling_for(target)` from before the config is
    created, so that platform defaults (dtype, block size) are the target's.
    """
    parallel = config.parallel_config
    if parallel.target_topology is None:
        raise ValueError("plan needs a compile target: target_topology is not set")
    target = compile_target(parallel.target_topology)
    tp = parallel.tensor_parallel_size
    if tp > len(target.devices):
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} chips; {target.topology} has "
            f"{len(target.devices)}"
        )
    dp = data_parallel_size
    if not isinstance(dp, int) or dp < 1 or tp * dp > len(target.devices):
        raise ValueError(
            f"data_parallel_size={dp}: allowed 1 to {len(target.devices) // tp} (replicas of "
            f"tensor_parallel_size={tp} chips on the {len(target.devices)} of {target.topology})"
        )
    report = {**_header(config, target), "data_parallel_size": dp}
    return with_replicas(_plan_one(config, target, report, every), dp)


def with_replicas(report: dict[str, Any], dp: int) -> dict[str, Any]:
    """`report` (one engine's plan) with one replica's figures and those of `dp` replicas:
    chips, KV cache tokens, concurrent requests and the decode estimate at full batch
    scale with the replica count (replicas share nothing)."""
    pc = report["per_chip"]
    est = report.get("decode_estimate")
    tp = report["tensor_parallel_size"]
    per_replica = {
        "chips": tp,
        "weight_bytes": pc["weight_bytes"] * tp,
        "kv_cache_tokens": pc["kv_cache_tokens"],
        "max_num_seqs": report["max_num_seqs"],
        "batch_max_tok_s": est["batch_max_tok_s"] if est else None,
    }
    total = {key: None if value is None else value * dp for key, value in per_replica.items()}
    return {**report, "per_replica": per_replica, "total": total}


def _plan_one(
    config: XlmConfig, target: CompileTarget, report: dict[str, Any], every: bool
) -> dict[str, Any]:
    """One engine's plan: the worker built for the target, its programs compiled."""
    budget = _Budget(target.chip.hbm_bytes, config.cache_config.memory_utilization)
    auto_kv = config.cache_config.num_blocks is None
    try:
        worker = Worker(config)
    except KVCacheTooSmallError as e:
        return {**report, **_weights_do_not_fit(e, config, budget)}
    report["dtype"] = jnp.dtype(worker.kv_dtype).name
    report["block_size"] = config.cache_config.block_size
    specs = worker.model_runner.program_specs()
    report["num_programs"] = len(specs)
    kinds = [key.kind.value for key in specs]
    report["num_programs_by_kind"] = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    report["host_kv_tier"] = host_kv_tier_plan(worker, target)
    if auto_kv:
        worker, programs, refused, grown = _compile_sized(config, worker, budget, every)
    else:
        (programs, refused), grown = _compile_chosen(worker, every), []
    sizes = _sizes(worker)
    if refused is not None:
        growth = f" (temporaries grew with the cache: {'; '.join(grown)})" if grown else ""
        return {
            **report,
            "fits": False,
            "reason": f"the compiler refused {refused.key.kind.value}[{refused.key.size}]: "
            f"{refused}{growth}",
            "per_chip": budget.per_chip(sizes, refused.temp_bytes, None),
            "programs": [p.as_json() for p in programs.values()],
            "temp_grows_with_cache": grown,
            "decode_estimate": None,
        }
    max_temp = max(p.temp_bytes for p in programs.values())
    total = sum(sizes[k] for k in ("weight_bytes", "encoder_cache_bytes", "kv_cache_bytes"))
    total += max_temp
    fits = total <= budget.allowed
    needs = (
        f"weights ({sizes['weight_bytes']}), the encoder cache ({sizes['encoder_cache_bytes']}), "
        f"the KV cache ({sizes['kv_cache_bytes']}) and the largest program's temporaries "
        f"({max_temp})"
    )
    if grown:
        needs += f"; temporaries grew with the cache: {'; '.join(grown)}"
    tokens = sizes["kv_cache_tokens"]
    max_seqs = config.scheduler_config.max_num_seqs
    batch_1 = decode_estimate(worker, target, programs, 1, tokens)
    batch_max = decode_estimate(worker, target, programs, max_seqs, tokens)
    return {
        **report,
        "fits": fits,
        "reason": None if fits else budget.over(needs, total),
        "per_chip": budget.per_chip(sizes, max_temp, total),
        "programs": [p.as_json() for p in programs.values()],
        "temp_grows_with_cache": grown,
        "decode_estimate": {
            "max_num_seqs": max_seqs,
            "batch_1_tok_s": batch_1["tok_s"],
            "batch_max_tok_s": batch_max["tok_s"],
            "batch_1": batch_1,
            "batch_max": batch_max,
        },
    }
