"""Speculative decoding (n-gram) through the engine: greedy output equal token for token
to the engine without it, in a preempting batch with prefix caching; no compilation after
warm-up; proposals counted in the stats; requests it must not touch left alone."""

from __future__ import annotations

import re

import numpy as np
import pytest

import xlm
from tests.engine.reference import (
    PREEMPTING_POOL,
    SMALL_ENGINE,
    SMOLLM2_ENGINE,
    num_preemptions,
    scheduler,
    small_engine,
)
from xlm.sampling_params import SamplingParams, StructuredOutputsParams

# Speculate at any batch size (so the 32-request batch verifies proposals while it
# preempts); proposals of up to 3 tokens from suffixes of 1 to 3 tokens.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}


def word_prompts(n: int) -> list[str]:
    """Prompts of the tiny tokenizer's words, some repeating spans (n-gram food), with
    shared prefixes (prefix-cache hits)."""
    prompts = []
    for i in range(n):
        span = " ".join(f"w{(5 * i + j) % 60}" for j in range(4 + i % 5))
        shared = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17" if i % 3 else ""
        prompts.append(f"{shared} {span} w{i} {span}".strip())
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def draft_spec(model: str) -> dict:
    """Speculate with a draft model at any batch size, k tokens always (a tiny draft costs
    as much as its target: the adaptive policy would soon stop proposing)."""
    return {
        "method": "draft_model",
        "model": model,
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
        "adaptive": False,
    }


_references: dict[str, list[list[int]]] = {}


def batch_of_32() -> tuple[list[dict], list[SamplingParams]]:
    # Token ids of the tiny tokenizer's words (special tokens first), which every family's
    # checkpoint shares (transformers picks a family's own tokenizer class for some).
    prompts = [{"prompt_token_ids": [6 + int(w[1:]) for w in p.split()]} for p in word_prompts(32)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24 + 4 * (i % 5), ignore_eos=True)
        for i in range(32)
    ]
    return prompts, params


def reference_ids(path: str) -> list[list[int]]:
    """The engine's greedy ids without speculation for the 32-request batch (once per
    checkpoint: both proposers' tests compare with it)."""
    if path not in _references:
        prompts, params = batch_of_32()
        _references[path] = token_ids(small_engine(path).generate(prompts, params, use_tqdm=False))
    return _references[path]


def check_speculating_batch(
    path: str, spec: dict, *, accepts: bool = True, pool: dict | None = None
) -> None:
    """The 32-request batch (it preempts, with prefix-cache hits) with `spec` equals the
    engine without it token for token, compiles nothing after warm-up, and leaves the KV
    pool whole (rolled-back proposals kept no block); one of its requests alone too. The
    engines have SMALL_ENGINE's shapes (8 requests at once: fewer programs to compile than
    32, and speculation's are the same at any size), with `pool` changing its KV pool."""
    prompts, params = batch_of_32()
    want = reference_ids(path)
    llm = xlm.LLM(model=path, speculative_config=spec, **dict(SMALL_ENGINE, **(pool or {})))
    compiled = llm.llm_engine.num_compilations
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.num_compilations == compiled, "a program compiled after warm-up"
    assert token_ids(got) == want
    stats = llm.get_stats()
    assert stats.spec_num_draft_tokens > 0, stats
    if accepts:
        assert stats.spec_num_accepted_tokens > 0, stats
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert num_preemptions(llm) > 0, "the batch did not preempt"
    assert stats.prefix_cache_hits > 0
    assert scheduler(llm).kv_cache_manager.usage == 0.0
    # Alone, too (speculation's own batch, no neighbours).
    (alone,) = llm.generate(prompts[5:6], params[5:6], use_tqdm=False)
    assert list(alone.outputs[0].token_ids) == want[5]
    assert llm.llm_engine.num_compilations == compiled


# The n-gram proposer is the same for every family and its proposals go through the
# verification the draft-model sweep below runs per family; one family here, Gemma 3, whose
# full and sliding-window layers in two KV cache groups cover plain attention too (SmolLM2's
# n-gram tests below cover Llama).
def test_greedy_with_ngram_proposals_equals_without(tiny_checkpoint):
    check_speculating_batch(tiny_checkpoint("gemma3"), SPEC)


# The draft runs the family's own model code, which tests/engine/test_llm_greedy.py checks
# against transformers for every family; what speculation adds per family is how the
# draft's kept K/V and positions behave, so one family for each distinct case: learned
# absolute positions (gpt2), sliding and full KV cache groups (gemma3; its sliding layers
# are the sliding-window case) and routed experts (qwen3_moe). Plain rotary attention with
# a tied head is SmolLM2 drafting for itself below (a Llama with a tied head).
DRAFT_FAMILIES = ["gemma3", "gpt2", "qwen3_moe"]


@pytest.mark.parametrize("arch", DRAFT_FAMILIES)
def test_greedy_with_a_draft_model_equals_without(tiny_checkpoint, arch):
    """The checkpoint drafting for itself: nearly every proposal is accepted, so the
    draft's kept K/V (and its recomputation after a rejection) are exercised in every
    family, sliding windows and KV cache groups included."""
    path = tiny_checkpoint(arch)
    check_speculating_batch(path, draft_spec(path))


def test_a_draft_that_disagrees_changes_nothing(tiny_checkpoint, tmp_path):
    """An unrelated one-layer draft: its proposals are almost all rejected, and the output
    is still exactly the target's."""
    from tests.conftest import write_tiny_checkpoint

    draft = write_tiny_checkpoint("llama", str(tmp_path / "draft"), seed=7, num_hidden_layers=1)
    # Llama's batch of 8 running requests fits 24 blocks: a smaller pool makes it preempt.
    check_speculating_batch(
        tiny_checkpoint("llama"), draft_spec(draft), accepts=False, pool=PREEMPTING_POOL
    )


def test_a_draft_of_another_vocabulary_is_refused(tiny_checkpoint, tmp_path):
    from tests.conftest import write_tiny_checkpoint

    draft = write_tiny_checkpoint("llama", str(tmp_path / "draft"), vocab_size=300)
    with pytest.raises(ValueError, match="its vocab_size 300 is not the target model's 256"):
        xlm.LLM(model=tiny_checkpoint("llama"), speculative_config=draft_spec(draft))
    with pytest.raises(ValueError, match="SpeculativeConfig.model=None is invalid"):
        xlm.LLM(model=tiny_checkpoint("llama"), speculative_config={"method": "draft_model"})


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_smollm2(request, smollm2_gguf):
    """SmolLM2 speculating with prompt lookup, or with itself as the draft model."""
    if request.param == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 4}
    else:
        # Drafting for itself costs a whole step per token, which never pays: the policy
        # would stop proposing once it has timed the draft, so propose k always.
        spec = {
            "method": "draft_model",
            "model": smollm2_gguf,
            "num_speculative_tokens": 4,
            "adaptive": False,
        }
    return xlm.LLM(model=smollm2_gguf, speculative_config=spec, **SPEC_SMOLLM2_ENGINE)


# SmolLM2's engine shapes with one token bucket and 8 request rows (the tests below run at
# most 5 requests): half the programs to compile, the draft's included.
SPEC_SMOLLM2_ENGINE = dict(SMOLLM2_ENGINE, max_num_seqs=8, token_buckets=[64])


# Input-grounded prompts: the answer copies spans of the prompt.
GROUNDED = [
    "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the river "
    "bank.\nCopy: The quick brown fox",
    "Names: Alice Smith, Bob Jones, Carol White, David Brown. Repeat the names: Alice Smith,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Once upon a time there was a king. Once upon a time there was a queen. Once upon a",
]


_smollm2_references: dict[str, list] = {}


def smollm2_reference(llm, name: str, prompts: list[str], params) -> list:
    """SmolLM2's outputs without speculation, once for both proposers' tests."""
    if name not in _smollm2_references:
        _smollm2_references[name] = llm.generate(prompts, params, use_tqdm=False)
    return _smollm2_references[name]


# Greedy tokens per request: prompt lookup starts copying late (at 24 tokens only 15 of
# 4 x 24 were accepted); SmolLM2 drafting for itself is accepted from the first token on
# and costs 5 steps a round, so it decodes fewer.
GREEDY_TOKENS = {"ngram": 40, "draft_model": 24}


@pytest.fixture
def greedy_tokens(request, spec_smollm2) -> int:
    """GREEDY_TOKENS of the proposer this test runs with."""
    return GREEDY_TOKENS[request.node.callspec.params["spec_smollm2"]]


def test_smollm2_greedy_and_logprobs_equal_with_speculation(
    smollm2_llm, spec_smollm2, greedy_tokens
):
    n = greedy_tokens
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    want = smollm2_reference(smollm2_llm, f"grounded-{n}", GROUNDED, params)
    compiled = spec_smollm2.llm_engine.num_compilations
    before = spec_smollm2.get_stats()
    got = spec_smollm2.generate(GROUNDED, params, use_tqdm=False)
    assert spec_smollm2.llm_engine.num_compilations == compiled
    assert token_ids(got) == token_ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    # Each position's logprobs, top-2 included, come from its own verifying row.
    for g, w in zip(got, want):
        for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert lp_g.keys() == lp_w.keys()
            np.testing.assert_allclose(
                [lp_g[t].logprob for t in lp_g], [lp_w[t].logprob for t in lp_w], atol=2e-3
            )
    after = spec_smollm2.get_stats()
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    # Copying text: many of the 4 x n tokens come from accepted proposals.
    assert accepted > n, after
    assert after.spec_mean_accepted_length > 1.5
    # Alone, too.
    (alone,) = spec_smollm2.generate(GROUNDED[2:3], params, use_tqdm=False)
    assert list(alone.outputs[0].token_ids) == token_ids(want)[2]
    assert spec_smollm2.llm_engine.num_compilations == compiled


def test_constrained_requests_beside_speculating_ones(smollm2_llm, spec_smollm2, greedy_tokens):
    """A grammar-constrained request is never proposed tokens (its mask depends on every
    token before), yet shares the steps of requests that are: all outputs equal the
    engine without speculation, and the constrained one matches its regex."""
    greedy = SamplingParams(temperature=0.0, max_tokens=greedy_tokens - 8, ignore_eos=True)
    regex = r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){1,3}"
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    prompts = [*GROUNDED, "Names of three cities:"]
    params = [greedy] * len(GROUNDED) + [constrained]
    want = smollm2_reference(smollm2_llm, f"constrained-{greedy_tokens}", prompts, params)
    before = spec_smollm2.get_stats()
    got = spec_smollm2.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert re.fullmatch(regex, got[-1].outputs[0].text), got[-1].outputs[0].text
    after = spec_smollm2.get_stats()
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens


def test_sampled_requests_are_reproducible_and_penalised_ones_never_proposed(spec_smollm2):
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=17, max_tokens=16, ignore_eos=True)
    first = spec_smollm2.generate(GROUNDED, seeded, use_tqdm=False)
    again = spec_smollm2.generate(GROUNDED, seeded, use_tqdm=False)
    assert token_ids(first) == token_ids(again)
    assert all(len(ids) == 16 for ids in token_ids(first))
    before = spec_smollm2.get_stats()
    penalised = SamplingParams(
        temperature=0.0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True
    )
    out = spec_smollm2.generate(GROUNDED, penalised, use_tqdm=False)
    assert all(len(ids) == 16 for ids in token_ids(out))
    assert spec_smollm2.get_stats().spec_num_draft_tokens == before.spec_num_draft_tokens


def test_speculation_with_the_pooling_runner_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="speculative_config is invalid with the pooling"):
        xlm.LLM(model=tiny_checkpoint("llama"), runner="pooling", speculative_config=SPEC)


def test_the_cli_flag_takes_vllm_json_and_turns_async_scheduling_off(tiny_checkpoint):
    from xlm.engine.arg_utils import EngineArgs
    from xlm.entrypoints.cli import build_parser

    flag = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    args = build_parser("serve").parse_args(
        ["serve", tiny_checkpoint("llama"), "--speculative-config", flag]
    )
    config = EngineArgs.from_cli_args(args).create_config()
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 5, 3)
    assert not config.scheduler_config.async_scheduling
    bad = build_parser("serve").parse_args(
        ["serve", tiny_checkpoint("llama"), "--speculative-config", '{"method": "medusa"}']
    )
    with pytest.raises(ValueError, match="SpeculativeConfig.method='medusa' is invalid"):
        EngineArgs.from_cli_args(bad).create_config()
