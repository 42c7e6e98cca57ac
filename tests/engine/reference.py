"""Engine-test helpers: small engine settings and transformers' greedy reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Small engines: chunked prefill with a 64-token step budget, two token buckets, and a KV
# pool small enough that a batch of 32 requests must preempt. Tests that build engines
# with the same shapes share compiled programs through the session compilation cache.
# They compile every program first, so their compile counts are exact from the start
# (tests/worker/test_compilation.py covers the other start-up modes).
TINY_ENGINE = dict(
    startup_programs="all",
    max_model_len=256,
    block_size=16,
    max_num_seqs=32,
    max_num_batched_tokens=64,
    token_buckets=[16, 64],
    enable_chunked_prefill=True,
    num_gpu_blocks_override=24,
)
SMOLLM2_ENGINE = dict(TINY_ENGINE, num_gpu_blocks_override=20)
# TINY_ENGINE with half its programs: one token bucket (one model program) and 8 request
# rows (one sampler program, FEW_ROWS's). For tests whose behaviour is not about buckets or
# wide steps: a batch of 32 still preempts its 24 blocks (8 running requests outgrow
# them), except where few blocks per request are held (PREEMPTING_POOL).
SMALL_ENGINE = dict(TINY_ENGINE, max_num_seqs=8, token_buckets=[64])
# A pool 8 running requests outgrow even when each holds few blocks (a sliding window, short
# requests), for models of one KV cache group (it holds one request of max_model_len).
PREEMPTING_POOL = dict(num_gpu_blocks_override=12, max_model_len=176)

# (checkpoint, engine options' name) -> the session's one LLM of them.
_session_engines: dict[tuple[str, str], object] = {}


def _session_engine(path: str, name: str, options: dict):
    if (path, name) not in _session_engines:
        import xlm

        _session_engines[path, name] = xlm.LLM(model=path, **options)
    return _session_engines[path, name]


def tiny_engine(path: str):
    """The session's one TINY_ENGINE LLM of a checkpoint: tests that only generate greedily
    with it share it (each build loads weights and every program again)."""
    return _session_engine(path, "tiny", TINY_ENGINE)


def small_engine(path: str):
    """The session's one SMALL_ENGINE LLM of a checkpoint (like tiny_engine)."""
    return _session_engine(path, "small", SMALL_ENGINE)


def cli_engine_flags(engine: dict) -> list[str]:
    """The `xlm generate` / examples flags for an engine dict like TINY_ENGINE."""
    return [
        "--max-model-len",
        str(engine["max_model_len"]),
        "--block-size",
        str(engine["block_size"]),
        "--max-num-seqs",
        str(engine["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(engine["max_num_batched_tokens"]),
        "--token-buckets",
        ",".join(map(str, engine["token_buckets"])),
        "--num-gpu-blocks-override",
        str(engine["num_gpu_blocks_override"]),
    ]


@dataclass
class Greedy:
    """transformers' greedy continuation of one prompt and the raw logits of each step."""

    token_ids: list[int]
    logits: np.ndarray  # [num_new_tokens, vocab] float32


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> Greedy:
    """`model.generate(do_sample=False)` on one unpadded prompt, EOS ignored."""
    import torch

    model.generation_config.eos_token_id = None  # like ignore_eos: always max_new_tokens
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return Greedy(
        token_ids=out.sequences[0, len(prompt_ids) :].tolist(),
        logits=torch.cat(out.logits).float().numpy(),
    )


def load_hf(path: str):
    """A tiny checkpoint in transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def mixed_batch(
    rng: np.random.Generator, n: int, vocab_size: int, max_prompt: int, max_new: int
) -> list[tuple[list[int], int]]:
    """n random (prompt token ids, max_tokens) of varied lengths; ids avoid specials 0-5."""
    out = []
    for _ in range(n):
        length = int(rng.integers(2, max_prompt + 1))
        prompt = rng.integers(6, vocab_size, size=length).tolist()
        out.append((prompt, int(rng.integers(1, max_new + 1))))
    return out


def num_preemptions(llm) -> int:
    return scheduler(llm).make_stats().num_preemptions


def scheduler(llm):
    """The in-process engine core's scheduler (counters: prefix hits, preemptions, KV)."""
    return llm.llm_engine.engine_core.engine_core.scheduler
