"""Pieces shared by the engine benchmarks (throughput.py, peers.py).

Importable from any interpreter that has numpy: peers.py runs its llama.cpp and vLLM
workers in their own virtual environments, which have neither xlm nor jax, so every
engine import stays inside the runner that needs it.

A runner has `generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]`:
token ids in, greedy token ids out, end-of-sequence ignored.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: read + write of a large warm buffer, best of `repeats`."""
    src = np.ones(num_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def settle(max_load: float, timeout: float) -> float:
    """Wait until the 1-minute load average is below `max_load` (the conventions' quiet
    machine: the last engine's own exit keeps it near 2 for a minute), at most `timeout`
    seconds; the load it ends at, which the caller records."""
    deadline = time.monotonic() + timeout
    while (load := os.getloadavg()[0]) >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    return load


def time_call(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, result


def single_request(runner: Any, prompt: list[int], output_len: int, repeats: int) -> dict:
    """Wall times of one request: `repeats` of max_tokens=1 (its time is the TTFT) and
    `repeats` of max_tokens=output_len. Decode tok/s = (output_len - 1) / (T(L) - T(1))."""
    return {
        "ttft_s": [time_call(runner.generate, [prompt], 1)[0] for _ in range(repeats)],
        "full_s": [time_call(runner.generate, [prompt], output_len)[0] for _ in range(repeats)],
    }


class XlmRunner:
    def __init__(self, model: str, max_num_seqs: int, **engine_args: Any) -> None:
        import xlm

        t = time.perf_counter()
        # Steady state: every program compiled before anything is timed.
        engine_args = {"startup_programs": "all", **engine_args}
        self.llm = xlm.LLM(model=model, max_num_seqs=max_num_seqs, **engine_args)
        self.startup_s = time.perf_counter() - t
        self.xlm = xlm
        self.vocab_size = self.llm.get_tokenizer().vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters on the device (what a decode step streams)."""
        import jax

        runner = self.llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(runner.state))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.xlm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HfRunner:
    """transformers in float32, eager PyTorch (no torch.compile), one batched `generate`."""

    def __init__(self, path: str) -> None:
        """`path`: a GGUF file (transformers dequantizes it) or a Hugging Face directory."""
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        if os.path.isdir(path):
            d, kwargs = path, {}
        else:
            d, f = os.path.split(path)
            kwargs = {"gguf_file": f}
        self.model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kwargs).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        pad = 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as batched generate needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=pad,
            )
        return [row[width:].tolist() for row in out]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
