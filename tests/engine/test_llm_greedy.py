"""Greedy xlm.LLM generation equals transformers' generate, alone and in a preempting batch."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.conftest import TINY_CONFIGS, VOCAB_SIZE
from tests.engine.reference import (
    PREEMPTING_POOL,
    SMALL_ENGINE,
    TINY_ENGINE,
    hf_greedy,
    load_hf,
    mixed_batch,
    num_preemptions,
    small_engine,
)

TINY_NEW_TOKENS = 24
SMOLLM2_NEW_TOKENS = 32
BATCH_SIZE = 32
# Where the reference requests sit inside the batch of 32.
REFERENCE_SLOTS = (0, 13, 31)


def greedy(max_tokens: int) -> xlm.SamplingParams:
    return xlm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_in_preempting_batch(llm, prompts, max_tokens, vocab_size, max_prompt, max_new, seed):
    """Generate `prompts` among 32 mixed-length requests; returns their outputs, preemptions."""
    rng = np.random.default_rng(seed)
    fillers = mixed_batch(rng, BATCH_SIZE - len(prompts), vocab_size, max_prompt, max_new)
    batch = list(fillers)
    for slot, prompt in zip(REFERENCE_SLOTS, prompts):
        batch.insert(slot, (prompt, max_tokens))
    # Fillers sample at temperature 1 so the batch mixes greedy and random rows.
    params = [
        greedy(n) if i in REFERENCE_SLOTS else xlm.SamplingParams(max_tokens=n, ignore_eos=True)
        for i, (_, n) in enumerate(batch)
    ]
    before, compiled = num_preemptions(llm), llm.llm_engine.num_compilations
    outputs = llm.generate([p for p, _ in batch], params, use_tqdm=False)
    assert llm.llm_engine.num_compilations == compiled  # no program compiled while serving
    for (prompt, n), out in zip(batch, outputs):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == n
    return [outputs[i] for i in REFERENCE_SLOTS], num_preemptions(llm) - before


# ---- tiny random checkpoints of every architecture ------------------------------------


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_case(request, tiny_checkpoint):
    """(engine, transformers references) for one architecture, built once. SMALL_ENGINE's
    shapes (one token bucket, 8 request rows: half of TINY_ENGINE's programs) run every
    family; the bucket choice and wide steps are model-independent (the half-weight test
    below runs TINY_ENGINE's two buckets and 32 rows)."""
    path = tiny_checkpoint(request.param)
    if request.param == "mistral":  # a window of 8 holds few blocks: a smaller pool preempts
        llm = xlm.LLM(model=path, **dict(SMALL_ENGINE, **PREEMPTING_POOL))
    else:
        llm = small_engine(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 17, 70)]
    hf = load_hf(path)
    refs = [hf_greedy(hf, p, TINY_NEW_TOKENS).token_ids for p in prompts]
    return llm, prompts, refs


def test_tiny_greedy_alone_equals_transformers(tiny_case):
    llm, prompts, refs = tiny_case
    compiled = llm.llm_engine.num_compilations
    for prompt, ref in zip(prompts, refs):
        (out,) = llm.generate([prompt], greedy(TINY_NEW_TOKENS), use_tqdm=False)
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
    assert llm.llm_engine.num_compilations == compiled  # warm-up compiled every program


def test_tiny_greedy_in_preempting_batch_equals_transformers(tiny_case):
    llm, prompts, refs = tiny_case
    outs, preempted = run_in_preempting_batch(
        llm, prompts, TINY_NEW_TOKENS, VOCAB_SIZE, max_prompt=120, max_new=24, seed=2
    )
    assert preempted > 0, "the KV pool was meant to be too small for the batch"
    assert [o.outputs[0].token_ids for o in outs] == refs


# ---- half weights on CPU, and float32 through the few-rows kernel ----------------------


def rounded_hf(path: str, dtype: str):
    """transformers in float32 on the checkpoint's weights rounded to `dtype`: the numbers
    xlm's half weights with float32 activations compute with."""
    import torch

    hf = load_hf(path)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    return hf


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_half_weights_equal_transformers_on_the_same_weights(tiny_checkpoint, dtype):
    import xlm.platforms

    if not xlm.platforms.current_platform.is_cpu():
        pytest.skip("half weights with float32 activations are the CPU's dtype mode")
    path = tiny_checkpoint("llama")
    llm = xlm.LLM(model=path, dtype=dtype, **TINY_ENGINE)
    hf = rounded_hf(path, dtype)
    rng = np.random.default_rng(1)
    compiled = llm.llm_engine.num_compilations
    for n in (5, 17, 70):
        prompt = rng.integers(6, VOCAB_SIZE, size=n).tolist()
        (out,) = llm.generate([prompt], greedy(TINY_NEW_TOKENS), use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, TINY_NEW_TOKENS).token_ids
    # A batch: decode steps of more than 8 rows take the kernel's packed tiles.
    prompts = [rng.integers(6, VOCAB_SIZE, size=int(n)).tolist() for n in rng.integers(3, 20, 12)]
    outs = llm.generate(prompts, greedy(TINY_NEW_TOKENS), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, TINY_NEW_TOKENS).token_ids
    assert llm.llm_engine.num_compilations == compiled


def test_tiny_float32_through_the_kernel_equals_xla_dot(tiny_checkpoint, monkeypatch):
    from xlm.ops import FloatMatmul, cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels here")
    path = tiny_checkpoint("llama")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(6, VOCAB_SIZE, size=n).tolist() for n in (5, 17, 70)]
    # The kernel is the default; off, the projections keep [in, out] and XLA's dot.
    monkeypatch.setattr(FloatMatmul, "float32_kernel", False)  # part of the programs' key
    xla_llm = xlm.LLM(model=path, **SMALL_ENGINE)
    plain = xla_llm.generate(prompts, greedy(TINY_NEW_TOKENS), use_tqdm=False)
    monkeypatch.setattr(FloatMatmul, "float32_kernel", True)
    # SMALL_ENGINE's 8 logit rows: the 1- and 8-row steps take the kernel, the projections'
    # kernels stored [out, in], prefill's 70 rows XLA's dot on them.
    llm = xlm.LLM(model=path, **SMALL_ENGINE)
    compiled = llm.llm_engine.num_compilations
    outs = llm.generate(prompts, greedy(TINY_NEW_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.num_compilations == compiled
    # The stored kernels: the same values, transposed.
    kernels, xla_kernels = stored_kernels(llm), stored_kernels(xla_llm)
    assert kernels.keys() == xla_kernels.keys() and kernels
    for name, kernel in kernels.items():
        np.testing.assert_array_equal(kernel, xla_kernels[name].T, err_msg=name)


def stored_kernels(llm) -> dict[str, np.ndarray]:
    """The projections' stored kernels (xlm.models.layers.Linear) by parameter path."""
    from flax import nnx

    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    flat = nnx.to_flat_state(runner.state)
    paths = {".".join(map(str, path)): var.get_value() for path, var in flat}
    return {p: np.asarray(v) for p, v in paths.items() if p.endswith("_proj.kernel")}


# ---- SmolLM2-135M-Instruct ------------------------------------------------------------

SMOLLM2_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
)
# float32 logits of two implementations differ by ~1e-5; where transformers' top two
# logits are closer than this, either token is a correct greedy choice.
NEAR_TIE = 1e-4


def assert_greedy_matches(got: list[int], ref_tokens: list[int], ref_logits: np.ndarray):
    """Equal token for token, except a divergence at a float32 near-tie of the reference."""
    assert len(got) == len(ref_tokens)
    for i, (a, b) in enumerate(zip(got, ref_tokens)):
        if a == b:
            continue
        top2 = np.sort(ref_logits[i])[-2:]
        gap = float(top2[1] - top2[0])
        assert ref_logits[i][a] == top2[0] and gap < NEAR_TIE, (
            f"token {i}: xlm chose {a}, transformers {b} (top-2 logit gap {gap:.2e}); "
            f"xlm {got}, transformers {ref_tokens}"
        )
        return  # after a legitimate near-tie the continuations differ


@pytest.fixture(scope="module")
def smollm2_case(smollm2_llm, smollm2_transformers_model):
    tokenizer = smollm2_llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in SMOLLM2_QUESTIONS
    ]
    refs = [hf_greedy(smollm2_transformers_model, p, SMOLLM2_NEW_TOKENS) for p in prompts]
    return smollm2_llm, prompts, refs


@pytest.mark.slow
def test_smollm2_greedy_alone_equals_transformers(smollm2_case):
    llm, prompts, refs = smollm2_case
    for prompt, ref in zip(prompts, refs):
        (out,) = llm.generate([prompt], greedy(SMOLLM2_NEW_TOKENS), use_tqdm=False)
        completion = out.outputs[0]
        assert_greedy_matches(completion.token_ids, ref.token_ids, ref.logits)
        # Incremental detokenization ends with the same text as decoding all at once.
        assert completion.text == llm.get_tokenizer().decode(
            completion.token_ids, skip_special_tokens=True
        )


@pytest.mark.slow
def test_smollm2_greedy_in_preempting_batch_equals_transformers(smollm2_case):
    llm, prompts, refs = smollm2_case
    vocab_size = len(llm.get_tokenizer())
    outs, preempted = run_in_preempting_batch(
        llm, prompts, SMOLLM2_NEW_TOKENS, vocab_size, max_prompt=80, max_new=12, seed=3
    )
    assert preempted > 0, "the KV pool was meant to be too small for the batch"
    for out, ref in zip(outs, refs):
        assert_greedy_matches(out.outputs[0].token_ids, ref.token_ids, ref.logits)


def test_block_size_past_the_cpu_kernels_limit_equals_transformers(tiny_checkpoint):
    """Pages of 512 tokens (more than the CPU kernel takes) run on the jnp path."""
    path = tiny_checkpoint("llama")
    engine = dict(SMALL_ENGINE, block_size=512, num_gpu_blocks_override=4)
    llm = xlm.LLM(model=path, **engine)
    prompt = np.random.default_rng(3).integers(6, VOCAB_SIZE, size=17).tolist()
    (out,) = llm.generate([prompt], greedy(TINY_NEW_TOKENS), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(load_hf(path), prompt, TINY_NEW_TOKENS).token_ids
