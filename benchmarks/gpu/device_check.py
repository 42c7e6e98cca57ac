"""Issue 40's measurements on one GPU, one phase per process (device_check.sh runs them).

    python benchmarks/gpu/device_check.py PHASE --shape {8b,tiny} --out DIR

Phases, each appending JSON lines to DIR/device_check.jsonl as its figures come (a phase
stopped by its time limit keeps what it wrote):
- env: jax / jaxlib / torch versions, the devices and their kind, the driver.
- bandwidth: device copy bandwidth, bytes read + written by a jitted `x + 1` over a
  bfloat16 array (best of 10).
- xlm: the engine on the shape with dummy bfloat16 weights: one-request decode (the
  difference of 129 and 1 generated tokens, per token), TTFT of a 2048-token prompt,
  output tok/s at 64 and 256 concurrent requests (512-token prompts, 128 new tokens), each
  after a warm-up of the same workload, with the compilations counted in the timed runs;
  the anatomy of a decode step (its programs blocked on) and a profiler trace's GPU
  kernel time by kernel, at 1 and 64 requests.
- torch: the same shape and workloads through transformers + torch (eager, bfloat16,
  random weights) on the same device: the peer.
- kernel: the Pallas GPU attention kernel against the plain-jnp reference on one layer's
  decode batch (64 requests x 640 tokens), time per call.

`--shape tiny` (the CPU dry run CI takes, `JAX_PLATFORMS=cpu`) runs every phase on a small
llama of the same vocabulary with the workloads cut to a few requests and tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LLAMA_8B = os.path.join(ROOT, "benchmarks", "configs", "Llama-3.1-8B", "config.json")

# The workloads: issue 40's, and the dry run's cut to what a 2-core CPU runs in seconds.
WORKLOADS = {
    "8b": dict(
        decode_prompt=16,
        decode_tokens=128,
        ttft_prompt=2048,
        batch_prompt=512,
        batch_tokens=128,
        batches=(64, 256),
        max_model_len=4096,
        kernel_reqs=64,
        kernel_ctx=640,
        kernel_sweep_reqs=(64, 256),
        # Triton knobs: the defaults' neighbours (block_kv, kv splits, warps, stages).
        kernel_sweep=[
            dict(block_kv=64, num_kv_splits=1),
            dict(block_kv=64, num_kv_splits=4),
            dict(block_kv=128, num_kv_splits=1),
            dict(block_kv=128, num_kv_splits=4),
            dict(block_kv=32, num_kv_splits=4),
            dict(block_kv=64, num_kv_splits=4, num_stages=3),
            dict(block_kv=128, num_kv_splits=2, num_warps=8),
            dict(block_kv=64, num_kv_splits=8),
        ],
        copy_bytes=2 << 30,
        repeats=3,
        batch_repeats=2,
        peer_repeats=1,
        kernel_repeats=20,
        token_buckets=[16, 64, 256, 2048],
    ),
    "tiny": dict(
        decode_prompt=8,
        # Enough decode steps that (full - first) stays positive beside a loaded machine's
        # noise (8 steps of the tiny model came out below it once, in the full suite).
        decode_tokens=48,
        ttft_prompt=64,
        batch_prompt=16,
        batch_tokens=4,
        batches=(4, 8),
        max_model_len=256,
        kernel_reqs=2,
        kernel_ctx=32,
        kernel_sweep_reqs=(2,),
        kernel_sweep=[dict(block_kv=16, num_kv_splits=2)],
        copy_bytes=8 << 20,
        repeats=1,
        batch_repeats=1,
        peer_repeats=1,
        kernel_repeats=2,  # the kernels' interpreters are slow
        token_buckets=[16, 64, 2048],
    ),
}
# The dry run's model: Llama-3.1-8B's vocabulary and layout, scaled down.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


# The busiest stream's gaps between kernels, binned: (upper bound in seconds, label).
GAP_BINS = ((5e-6, "<5us"), (5e-5, "<50us"), (1e-3, "<1ms"), (float("inf"), ">=1ms"))


def emit(out: str, phase: str, **fields) -> None:
    line = json.dumps({"phase": phase, "time": time.strftime("%H:%M:%S"), **fields})
    print(line, flush=True)
    with open(os.path.join(out, "device_check.jsonl"), "a") as f:
        f.write(line + "\n")


def model_dir(shape: str, out: str) -> str:
    """A config-only checkpoint (weights come from --load-format dummy) with the tests'
    small word-level tokenizer: prompts are token ids and outputs are not detokenized."""
    path = os.path.join(out, f"model-{shape}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    with open(LLAMA_8B) as f:
        config = json.load(f)
    if shape == "tiny":
        config.update(TINY)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    sys.path.insert(0, ROOT)
    platforms = os.environ.get("JAX_PLATFORMS")
    from tests.conftest import build_tokenizer  # sets JAX_PLATFORMS=cpu for the tests

    if platforms is None:  # the first device run's engine ran on the CPU for it
        os.environ.pop("JAX_PLATFORMS", None)
    else:
        os.environ["JAX_PLATFORMS"] = platforms
    build_tokenizer().save_pretrained(path)
    return path


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab, size=(count, length)).tolist()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def warm_up(generate, count, length, tokens, vocab, seed) -> None:
    """The workload once, short: what its timed runs compile is compiled here."""
    generate(prompts(count, length, vocab, next(seed)), min(tokens, 4))


def first_and_full(generate, count, length, tokens, vocab, seed, repeats) -> tuple[float, float]:
    """Median seconds of `count` fresh prompts with 1 and with `tokens` new tokens (xlm and
    the peer alike, each after warm_up of the same workload); `seed` yields prompt seeds."""
    firsts, fulls = [], []
    for _ in range(repeats):
        firsts.append(timed(lambda: generate(prompts(count, length, vocab, next(seed)), 1)))
        fulls.append(timed(lambda: generate(prompts(count, length, vocab, next(seed)), tokens)))
    return statistics.median(firsts), statistics.median(fulls)


# ------------------------------------------------------------------------------ phases


def phase_env(args, w) -> None:
    import jax
    import jaxlib

    devices = jax.devices()
    driver = (
        shutil.which("nvidia-smi")
        and subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    emit(
        args.out,
        "env",
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        device_kind=devices[0].device_kind,
        devices=[str(d) for d in devices],
        nvidia_smi=driver or None,
        torch=torch_version,
        python=sys.version.split()[0],
        shape=args.shape,
    )


def phase_bandwidth(args, w) -> None:
    import jax
    import jax.numpy as jnp

    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.ones((w["copy_bytes"] // jnp.dtype(dtype).itemsize,), dtype)
        f = jax.jit(lambda a: a + 1)
        f(x).block_until_ready()
        best = min(timed(lambda f=f, x=x: f(x).block_until_ready()) for _ in range(10))
        emit(
            args.out,
            "bandwidth",
            bytes_moved=2 * x.nbytes,
            seconds=best,
            bytes_per_s=2 * x.nbytes / best,
            how=f"jit(x + 1) over {jnp.dtype(dtype).name}, read + write, best of 10",
        )


def phase_xlm(args, w, decode_only: bool = False) -> None:
    """The engine's figures; `decode_only` (phase "decode") stops after the one-request
    decode, its anatomy and profile: the run under each XLA_FLAGS variant to compare."""
    import xlm

    phase = "decode" if decode_only else "xlm"
    flags = os.environ.get("XLA_FLAGS", "")

    path = model_dir(args.shape, args.out)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    started = time.perf_counter()
    llm = xlm.LLM(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=w["max_model_len"],
        max_num_seqs=max(w["batches"]),
        enable_prefix_caching=False,
        startup_programs="used",
        token_buckets=w["token_buckets"],
    )
    engine = llm.llm_engine
    emit(
        args.out,
        phase,
        what="engine_ready",
        seconds=time.perf_counter() - started,
        xla_flags=flags,
    )

    def generate(ps: list[list[int]], tokens: int) -> list:
        params = xlm.SamplingParams(
            max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return outs

    seed = iter(range(1000))

    def measure(count: int, length: int, tokens: int) -> tuple[float, float, int]:
        """first_and_full, and the compilations in its timed runs."""
        warm_up(generate, count, length, tokens, vocab, seed)
        compiled = engine.num_compilations
        repeats = w["repeats"] if count == 1 else w["batch_repeats"]
        first, full = first_and_full(generate, count, length, tokens, vocab, seed, repeats)
        return first, full, engine.num_compilations - compiled

    first, full, compiles = measure(1, w["decode_prompt"], w["decode_tokens"] + 1)
    per_token = (full - first) / w["decode_tokens"]
    emit(
        args.out,
        phase,
        what="one_request_decode",
        prompt=w["decode_prompt"],
        new_tokens=w["decode_tokens"],
        seconds_per_token=per_token,
        tok_per_s=1 / per_token,
        first_token_s=first,
        compilations_timed=compiles,
    )

    runner = engine.engine_core.engine_core.executor.worker.model_runner

    def decode_steps(count: int, run, block: bool = False) -> tuple[Any, dict[str, float | int]]:
        """`run()`'s value, and the timing of its steps in which all `count` requests
        decode one token each (a 512-token prompt's prefill shares its first steps with
        the others' decode tokens: those are not decode steps): the median
        launch-to-launch interval, and with `block` the model program alone and with its
        sampler, each blocked on (nothing then overlaps: the steps run slower)."""
        import jax

        launches: list[tuple[float, bool]] = []
        spent: dict[str, list[tuple[float, bool]]] = {"model": [], "model_and_sampler": []}
        full = [False]

        def launch(req_ids, num_scheduled, step):
            full[0] = len(req_ids) == count and sum(num_scheduled) == count
            launches.append((time.perf_counter(), full[0]))
            return launch_fn(req_ids, num_scheduled, step)

        def blocking(fn, name):
            def call(*a):
                start = time.perf_counter()
                out = jax.block_until_ready(fn(*a))
                spent[name].append((time.perf_counter() - start, full[0]))
                return out

            return call

        launch_fn = runner._launch
        runner._launch = launch
        if block:
            runner._run_model = blocking(runner._run_model, "model")
            runner._run = blocking(runner._run, "model_and_sampler")
        try:
            value = run()
        finally:
            for name in ("_launch", "_run_model", "_run"):  # the class's methods again
                runner.__dict__.pop(name, None)
        steps = [b[0] - a[0] for a, b in zip(launches, launches[1:]) if a[1] and b[1]]
        out: dict[str, float | int] = {"decode_steps": len(steps)}
        if steps:
            out["decode_step_s"] = statistics.median(steps)
        for name, times in spent.items():
            decode = [t for t, full_step in times if full_step]
            if decode:
                out[f"{name}_s"] = statistics.median(decode)
        return value, out

    def anatomy(count: int, length: int) -> None:
        """Where a decode step's time goes (decode_steps, blocked): enough new tokens that
        every request decodes together for 32 steps after the last prefill."""
        prefill_steps = -(-count * length // w["token_buckets"][-1])
        tokens = prefill_steps + 33
        emit(
            args.out,
            phase,
            what="anatomy",
            requests=count,
            **decode_steps(
                count,
                lambda: generate(prompts(count, length, vocab, next(seed)), tokens),
                block=True,
            )[1],
        )

    def profile(count: int, length: int) -> None:
        """The device's own account of the decode steps: a profiler trace of the workload,
        parsed here (jax.profiler.ProfileData): its GPU kernels' time summed by name per
        stream line, the busiest stream's gaps and the host's events, against the wall
        time of the run. The trace is for reading: its failure is recorded, not raised."""
        try:
            emit(args.out, phase, what="profile", requests=count, **traced(count, length))
        except Exception as e:
            emit(args.out, phase, what="profile", error=f"{type(e).__name__}: {e}"[:2000])

    def traced(count: int, length: int) -> dict:
        import collections
        import glob
        import tempfile

        import jax
        from jax.profiler import ProfileData

        trace_dir = tempfile.mkdtemp()
        jax.profiler.start_trace(trace_dir)
        try:
            elapsed = timed(lambda: generate(prompts(count, length, vocab, next(seed)), 17))
        finally:
            jax.profiler.stop_trace()
        lines: dict[str, float] = collections.Counter()
        kernels: dict[str, float] = collections.Counter()
        calls: dict[str, int] = collections.Counter()
        host: dict[str, float] = collections.Counter()
        host_calls: dict[str, int] = collections.Counter()
        gaps = collections.Counter()  # idle time between kernels of the busiest stream
        for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
            for plane in ProfileData.from_file(path).planes:
                if plane.name.startswith("/host"):
                    for line in plane.lines:
                        for event in line.events:
                            name = event.name[:100]
                            if name.startswith("$"):  # Python frames: the runner's own
                                continue
                            host[name] += event.duration_ns / 1e9
                            host_calls[name] += 1
                    continue
                if not plane.name.startswith("/device:GPU"):
                    continue
                busiest = None
                for line in plane.lines:
                    events = sorted(line.events, key=lambda e: e.start_ns)
                    for event in events:
                        seconds = event.duration_ns / 1e9
                        lines[line.name] += seconds
                        if line.name.startswith("Stream"):
                            kernels[event.name[:120]] += seconds
                            calls[event.name[:120]] += 1
                    if line.name.startswith("Stream") and (
                        busiest is None or len(events) > len(busiest)
                    ):
                        busiest = events
                for a, b in zip(busiest or [], (busiest or [])[1:]):
                    idle = (b.start_ns - a.end_ns) / 1e9
                    kind = next(label for bound, label in GAP_BINS if idle < bound)
                    gaps[kind + "_s"] += max(idle, 0.0)
                    gaps[kind + "_n"] += 1
        return dict(
            new_tokens=17,
            wall_s=elapsed,
            lines_s=dict(lines),
            kernels_s={k: [v, calls[k]] for k, v in kernels.most_common(30)},
            busiest_stream_gaps=dict(gaps),
            host_s={k: [v, host_calls[k]] for k, v in host.most_common(40)},
        )

    anatomy(1, w["decode_prompt"])
    profile(1, w["decode_prompt"])
    if decode_only:
        return

    def concurrent(count: int) -> None:
        (first, full, compiles), steps = decode_steps(
            count, lambda: measure(count, w["batch_prompt"], w["batch_tokens"])
        )
        emit(
            args.out,
            phase,
            what="concurrent",
            requests=count,
            prompt=w["batch_prompt"],
            new_tokens=w["batch_tokens"],
            seconds=full,
            output_tok_per_s=count * w["batch_tokens"] / full,
            prefill_and_first_token_s=first,
            # Steps in which all the requests decode (not (full - first) / tokens: the
            # prefill's last steps carry the first requests' decode tokens).
            decode_step_s=steps.get("decode_step_s"),
            decode_steps=steps["decode_steps"],
            compilations_timed=compiles,
        )

    def ttft() -> None:
        first, _, compiles = measure(1, w["ttft_prompt"], 2)
        emit(
            args.out,
            phase,
            what="ttft",
            prompt=w["ttft_prompt"],
            seconds=first,
            compilations_timed=compiles,
        )

    # The TTFT's 2048-token bucket is the smaller batch's too; the larger batch compiles
    # its own decode bucket, so it comes last.
    smaller, *larger = w["batches"]
    concurrent(smaller)
    anatomy(smaller, w["batch_prompt"])
    profile(smaller, w["batch_prompt"])
    ttft()
    for count in larger:
        concurrent(count)
        anatomy(count, w["batch_prompt"])
    emit(
        args.out,
        phase,
        what="done",
        compilations_total=engine.num_compilations,
        seconds_total=time.perf_counter() - started,
    )


def phase_torch(args, w) -> None:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = model_dir(args.shape, args.out)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    vocab = config.vocab_size

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def generate(ps: list[list[int]], tokens: int) -> None:
        ids = torch.tensor(ps, device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] == ids.shape[1] + tokens
        sync()

    def copy_bandwidth() -> float:
        """The copy bandwidth as torch measures it (a device-to-device copy_), beside jax's."""
        x = torch.empty(w["copy_bytes"] // 2, dtype=torch.bfloat16, device=device)
        y = torch.empty_like(x)
        y.copy_(x)
        sync()
        return 2 * x.nbytes / min(timed(lambda: (y.copy_(x), sync())) for _ in range(10))

    emit(args.out, "torch", what="copy_bandwidth", bytes_per_s=copy_bandwidth())

    seed = iter(range(1000))

    def measure(count: int, length: int, tokens: int) -> tuple[float, float]:
        warm_up(generate, count, length, tokens, vocab, seed)
        return first_and_full(generate, count, length, tokens, vocab, seed, w["peer_repeats"])

    first, full = measure(1, w["decode_prompt"], w["decode_tokens"] + 1)
    per_token = (full - first) / w["decode_tokens"]
    emit(
        args.out,
        "torch",
        what="one_request_decode",
        seconds_per_token=per_token,
        tok_per_s=1 / per_token,
        first_token_s=first,
        transformers=transformers.__version__,
    )
    first, _ = measure(1, w["ttft_prompt"], 2)
    emit(args.out, "torch", what="ttft", prompt=w["ttft_prompt"], seconds=first)
    for count in w["batches"]:
        first, full = measure(count, w["batch_prompt"], w["batch_tokens"])
        emit(
            args.out,
            "torch",
            what="concurrent",
            requests=count,
            seconds=full,
            output_tok_per_s=count * w["batch_tokens"] / full,
            prefill_and_first_token_s=first,
            decode_step_s=(full - first) / (w["batch_tokens"] - 1),
        )


def phase_kernel(args, w) -> None:
    """Each attention kernel on one layer's decode batch (kernel_reqs requests of kernel_ctx
    tokens), then the Triton kernel's knobs swept at each of kernel_sweep_reqs: the figures
    its default_knobs are chosen from."""
    import traceback

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, ROOT)
    from pallas_kernels.ragged_paged_attention import (
        kv_cache_shape,
        ragged_paged_attention_gpu,
        ragged_paged_attention_mosaic_gpu,
        ragged_paged_attention_reference,
    )

    with open(LLAMA_8B) as f:
        config = json.load(f)
    if args.shape == "tiny":
        config.update(TINY)
    heads, kv_heads, dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    ctx, block = w["kernel_ctx"], 16
    per_req = -(-ctx // block)
    interpret = jax.default_backend() != "gpu"
    scale = dim**-0.5
    rng = np.random.default_rng(0)

    def batch(reqs: int) -> tuple:
        cache = jnp.asarray(
            rng.standard_normal(kv_cache_shape(reqs * per_req + 1, block, kv_heads, dim)),
            jnp.bfloat16,
        )
        q = jnp.asarray(rng.standard_normal((reqs, heads, dim)), jnp.bfloat16)
        tables = jnp.asarray(1 + np.arange(reqs * per_req).reshape(reqs, per_req), jnp.int32)
        lens = jnp.full((reqs,), ctx, jnp.int32)
        starts = jnp.arange(reqs + 1, dtype=jnp.int32)
        return q, cache, tables, lens, starts, jnp.asarray([reqs], jnp.int32)

    def run(name: str, kernel, args_, reference=None, **fields):
        """Time `kernel` (best of kernel_repeats) and emit it with its difference to the
        reference's output; returns the output (None when it failed)."""
        fn = jax.jit(kernel)
        try:
            out = fn(*args_).block_until_ready()
        except Exception as e:  # one kernel failing must not hide the others' figures
            traceback.print_exc()
            emit(args.out, "kernel", kernel=name, error=f"{type(e).__name__}: {e}"[:2000], **fields)
            return None
        best = min(
            timed(lambda f=fn: f(*args_).block_until_ready()) for _ in range(w["kernel_repeats"])
        )
        reqs = args_[0].shape[0]
        kv_bytes = 2 * reqs * ctx * kv_heads * dim * 2
        ref = out if reference is None else reference
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        emit(
            args.out,
            "kernel",
            kernel=name,
            requests=reqs,
            context=ctx,
            seconds=best,
            kv_bytes_per_s=kv_bytes / best,
            max_abs_difference_to_reference=diff,
            **fields,
        )
        return out

    args_ = batch(w["kernel_reqs"])
    reference = run(
        "reference_jnp",
        lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale),
        args_,
    )
    run(
        "pallas_triton",
        lambda *a: ragged_paged_attention_gpu(*a, sm_scale=scale, interpret=interpret),
        args_,
        reference,
    )
    run(
        "pallas_mosaic_gpu",
        lambda *a: ragged_paged_attention_mosaic_gpu(*a, sm_scale=scale, interpret=interpret),
        args_,
        reference,
    )
    for reqs in w["kernel_sweep_reqs"]:
        args_ = batch(reqs)
        reference = None
        for knobs in w["kernel_sweep"]:
            out = run(
                "pallas_triton",
                functools.partial(
                    ragged_paged_attention_gpu, sm_scale=scale, interpret=interpret, **knobs
                ),
                args_,
                reference,
                knobs=knobs,
            )
            reference = out if reference is None else reference


PHASES = {
    "env": phase_env,
    "bandwidth": phase_bandwidth,
    "xlm": phase_xlm,
    "decode": lambda args, w: phase_xlm(args, w, decode_only=True),
    "torch": phase_torch,
    "kernel": phase_kernel,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", choices=list(PHASES))
    parser.add_argument("--shape", choices=list(WORKLOADS), default="8b")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    PHASES[args.phase](args, WORKLOADS[args.shape])


if __name__ == "__main__":
    main()
