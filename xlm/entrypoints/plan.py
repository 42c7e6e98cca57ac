"""`xlm plan MODEL --target-topology v5e:2x2 [engine options] [--all] [--json]`: will the
model fit a TPU slice, what do its programs cost, how long do they take to compile,
answered here by compiling for the slice (libtpu, no TPU). See docs/tpu.md."""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax

from xlm import envs
from xlm.engine.arg_utils import EngineArgs
from xlm.entrypoints import console
from xlm.planning import plan
from xlm.platforms.target import compile_target, compiling_for

GB = 1e9


def add_parser(subparsers: Any, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=__doc__)
    parser.add_argument(
        "model_tag", metavar="MODEL", help="model directory (config.json is enough), or name"
    )
    parser.add_argument(
        "--target-topology",
        required=True,
        help="TPU slice or GPU node to compile for: v5e:2x2, v6e:2x4, v5p:2x2x1, v4:2x2x1, "
        "v5e:4x4 (several hosts), ..., h100:8, h200:8, a100:8 (needs jax[cuda12])",
    )
    parser.add_argument(
        "--all",
        dest="every",
        action="store_true",
        help="compile every program the engine "
        "would (default: per kind the smallest and largest, and the decode programs)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="replicas of tensor_parallel_size chips each on the topology: adds per-replica "
        "and total figures (default: 1)",
    )
    EngineArgs.add_cli_args(
        parser,
        skip=(
            "model",
            "data_parallel_size",
            "warmup",
            "compile_all_first",
            "startup_programs",
            "enable_compilation_cache",
        ),
    )
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    if not envs.jax_platforms():
        # Nothing runs here: keep JAX off any local accelerator (and a CUDA plugin with no
        # GPU from failing its start-up check); targets are described and compiled anyway.
        jax.config.update("jax_platforms", "cpu")
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag
    engine_args.target_topology = args.target_topology
    # Only the config is read: weights become ShapeDtypeStructs, whatever the directory has.
    engine_args.load_format = "dummy"
    # One replica is compiled; --data-parallel-size multiplies its figures (plan() below).
    engine_args.data_parallel_size = 1
    target = compile_target(args.target_topology)
    with compiling_for(target):
        config = engine_args.create_config()
        report = plan(config, every=args.every, data_parallel_size=args.data_parallel_size)
    if args.json:
        console.out(json.dumps(report, indent=2))
    else:
        console.out(format_report(report))
    if not report["fits"]:
        console.err(f"xlm plan: does not fit: {report['reason']}")
        return 1
    return 0


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"


def _replica_lines(r: dict[str, Any]) -> list[str]:
    """One replica's and all replicas' chips, KV tokens, requests and decode throughput."""
    if r.get("data_parallel_size", 1) == 1:
        return []

    def row(label: str, f: dict[str, Any]) -> str:
        tok_s = "-" if f["batch_max_tok_s"] is None else f"{f['batch_max_tok_s']:.0f}"
        return (
            f"  {label:<12}{f['chips']:>6}{_gb(f['weight_bytes']):>14}"
            f"{f['kv_cache_tokens']:>12}{f['max_num_seqs']:>10}{tok_s:>16}"
        )

    return [
        "",
        f"data parallel: {r['data_parallel_size']} replicas of TP={r['tensor_parallel_size']}",
        f"  {'':<12}{'chips':>6}{'weights':>14}{'KV tokens':>12}{'max seqs':>10}"
        f"{'decode tok/s':>16}",
        row("per replica", r["per_replica"]),
        row("total", r["total"]),
    ]


def format_report(r: dict[str, Any]) -> str:
    """The human-readable plan: per-chip memory, programs, decode estimate."""
    chip = r["chip"]
    pc = r["per_chip"]
    lines = [
        f"{r['model']} on {r['topology']} ({r['chips']} x {r['device_kind']}, "
        f"{r['hosts']} host(s) x {r['chips_per_host']} chips), TP={r['tensor_parallel_size']}, "
        f"max_model_len={r['max_model_len']}, max_num_seqs={r['max_num_seqs']}",
        f"chip {chip['name']}: {_gb(chip['hbm_bytes'])} HBM, "
        f"{chip['peak_bf16_flops'] / 1e12:.0f} TFLOP/s bf16, "
        f"{chip['hbm_bytes_per_s'] / GB:.0f} GB/s ({chip['source']})",
        *(
            [
                f"  measured copy bandwidth {chip['copy_bytes_per_s'] / GB:.0f} GB/s, what the "
                f"estimate uses ({chip['copy_source']})"
            ]
            if chip.get("copy_bytes_per_s")
            else []
        ),
        "",
        "per chip:",
        f"  weights            {_gb(pc['weight_bytes'])}",
        *(
            [
                f"    of which encoder {_gb(pc['encoder_weight_bytes'])} (vision tower and "
                "projector, replicated)",
                f"  encoder cache      {_gb(pc['encoder_cache_bytes'])}",
            ]
            if pc.get("encoder_weight_bytes")
            else []
        ),
        f"  KV cache           {_gb(pc['kv_cache_bytes'])} ({pc['kv_cache_tokens']} tokens)",
        f"  largest temp       {_gb(pc['max_temp_bytes'])}",
        f"  total              {_gb(pc['total_bytes'])} of {_gb(pc['hbm_bytes'])} "
        f"(budget {_gb(pc['budget_bytes'])} at memory_utilization={r['memory_utilization']})",
        f"  fits               {'yes' if r['fits'] else 'NO: ' + str(r['reason'])}",
    ]
    host = r.get("host_kv_tier")
    if host:
        lines.append(
            f"host KV tier: {host['size_gib']} GiB of host memory per host, "
            f"{host['blocks']} blocks ({host['tokens']} tokens, "
            f"{host['block_bytes_per_host']} bytes a block)"
        )
    if r["programs"]:
        lines += [
            "",
            f"programs: {len(r['programs'])} compiled of {r['num_programs']}",
            f"  {'program':<22}{'compile s':>10}{'Pallas':>8}{'GFLOP':>12}{'MB accessed':>14}"
            f"{'temp MB':>10}",
        ]
        for p in r["programs"]:
            kernel = "yes" if p["pallas_kernel"] else "no"
            lines.append(
                f"  {p['name']:<22}{p['compile_s']:>10.1f}{kernel:>8}"
                f"{p['flops'] / 1e9:>12.1f}{p['bytes_accessed'] / 1e6:>14.1f}"
                f"{p['temp_bytes'] / 1e6:>10.1f}"
            )
    lines += _replica_lines(r)
    est = r.get("decode_estimate")
    if est:
        counted = any(p.get("cost_source") == "count" for p in r["programs"])
        source = (
            "xlm's own count of flops and bytes (this compiler reports no cost)"
            if counted
            else "the compiled cost"
        )
        lines += ["", f"decode, roofline estimate from {source} (not a measurement):"]
        for label in ("batch_1", "batch_max"):
            e = est[label]
            lines.append(
                f"  batch {e['batch']:>4} at {e['context_tokens']} tokens of context: "
                f"{e['step_ms']:.2f} ms/step, {e['tok_s']:.0f} tok/s"
            )
    return "\n".join(lines)
