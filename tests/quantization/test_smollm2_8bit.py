"""int8 and w8a8 on the real SmolLM2-135M (its embedding table / tied LM head in 8 bits
too; w8a8 in llama.cpp Q8_0's blocks of 32 inputs, weights and activations) against its
float32 engine: greedy continuations mostly agree, each first divergence is a near-tie of
float32's own, and no step recompiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.engine.reference import SMOLLM2_ENGINE

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which plants",
    "The largest planet in our solar system is",
    "In computer science, a linked list is",
]
NEW_TOKENS = 16
# Least mean matching prefix (of NEW_TOKENS), and the largest float32 log-probability gap
# between float32's choice and the quantized engine's at the first token they differ.
# Eight prompts are a coarse check, not a measure: w8a8's mean here went from 14.1 to 9.75
# when its prefill steps moved from float sums of the rounded activations to the exact
# int32 sums of its decode steps (the w8a8 kernels' strips, 2026-11-28), while on the 64
# held-out prompts x 128 tokens of benchmarks/quantization.py its agreement rose (mean
# matching prefix 39.0 -> 41.6, identical outputs 9 -> 11 of 64; RESULTS.md). The near-tie
# bound below is the substantive check.
MIN_MEAN_PREFIX = 9.0
MAX_GAP = 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The agreement depends on where rounding flips a near-tie, so it is measured with the
# numerics users run: XLA's default compile options, in a subprocess (the suite compiles
# without LLVM's optimisation passes, tests/conftest.py, which moves such flips: mean
# prefix 9.5 there against 14.1 here for w8a8 on these prompts).
CHECK = """
import json, sys
import xlm
from tests.quantization.test_smollm2_8bit import AGREEMENT_ENGINE, NEW_TOKENS, PROMPTS, agreement
model, schemes = sys.argv[1], sys.argv[2:]
params = xlm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
# The reference compiles only the programs its steps run (no compile count is checked on it).
floats = xlm.LLM(model=model, **dict(AGREEMENT_ENGINE, startup_programs="used"))
floats = floats.generate(PROMPTS, params, use_tqdm=False)
print(json.dumps({scheme: agreement(model, scheme, params, floats) for scheme in schemes}))
"""
# The shapes the agreement bounds were measured with (other shapes may move a near-tie).
AGREEMENT_ENGINE = SMOLLM2_ENGINE


def agreement(model: str, scheme: str, params, floats: list) -> list[int] | str:
    """The quantized engine's matching prefixes against `floats`, or why it failed."""
    import xlm

    llm = xlm.LLM(model=model, quantization=scheme, **AGREEMENT_ENGINE)
    compiled = llm.llm_engine.num_compilations
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    try:
        assert llm.llm_engine.num_compilations == compiled, "a program compiled after warm-up"
        return check_agreement(scheme, floats, outs)
    except AssertionError as e:
        return f"AssertionError: {e!r}"
    finally:
        llm.llm_engine.engine_core.shutdown()


def check_agreement(scheme: str, floats: list, outs: list) -> list[int]:
    """Each request's matching prefix; the first divergence a near-tie of float32's own."""
    prefixes = []
    for ref, out in zip(floats, outs):
        want, got = ref.outputs[0].token_ids, out.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), NEW_TOKENS)
        prefixes.append(n)
        if n < NEW_TOKENS:  # the same prefix so far: float32's logprobs at n apply
            lps = ref.outputs[0].logprobs[n]
            assert got[n] in lps, (scheme, n)
            assert lps[want[n]].logprob - lps[got[n]].logprob < MAX_GAP, (scheme, n)
    assert sum(prefixes) / len(prefixes) >= MIN_MEAN_PREFIX, (scheme, prefixes)
    return prefixes


@pytest.fixture(scope="module")
def agreements(smollm2_gguf) -> dict:
    """Both schemes against one float32 engine, in one subprocess: scheme -> prefixes (or
    the failed assertion)."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-c", CHECK, smollm2_gguf, *SCHEMES],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


SCHEMES = ["int8", "w8a8"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first one's setup builds the three engines
@pytest.mark.parametrize("scheme", SCHEMES)
def test_8bit_agrees_with_float32(scheme, agreements):
    prefixes = agreements[scheme]
    assert isinstance(prefixes, list), prefixes
    assert len(prefixes) == len(PROMPTS)
