"""xlm.LLM on a tiny llama: sampling, logprobs, prefix caching, n, stops, API and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xlm
from tests.conftest import VOCAB_SIZE
from tests.engine.reference import (
    TINY_ENGINE,
    hf_greedy,
    load_hf,
    mixed_batch,
    num_preemptions,
    scheduler,
)

EOS = 2


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


# Step programs compiled by each engine's construction (warm-up), by id(engine).
WARMUP_COMPILATIONS: dict[int, int] = {}


@pytest.fixture(scope="module")
def llm(tiny_path):
    engine = xlm.LLM(model=tiny_path, **TINY_ENGINE)
    WARMUP_COMPILATIONS[id(engine)] = engine.llm_engine.num_compilations
    return engine


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    return load_hf(tiny_path)


def random_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(6, VOCAB_SIZE, size=length).tolist()


def greedy(max_tokens: int = 12, **kwargs) -> xlm.SamplingParams:
    return xlm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def assert_engine_idle(llm) -> None:
    """Nothing left running or waiting, and every KV block back in the pool."""
    assert not llm.llm_engine.has_unfinished_requests()
    stats = scheduler(llm).make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert stats.kv_cache_usage == 0.0


# ---- 2. seeded sampling ---------------------------------------------------------------


def test_seeded_sampling_reproducible_across_runs_and_batches(llm):
    prompt = random_prompt(10, 9)
    seeded = xlm.SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate([prompt], seeded, use_tqdm=False)
    (again,) = llm.generate([prompt], seeded, use_tqdm=False)
    assert tokens(again) == tokens(alone)

    others = [random_prompt(11 + i, 3 + 7 * i) for i in range(5)]
    unseeded = xlm.SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = others[:2] + [prompt] + others[2:]
    params = [unseeded, unseeded, seeded, unseeded, unseeded, unseeded]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert tokens(outs[2]) == tokens(alone)
    reversed_outs = llm.generate(batch[::-1], params[::-1], use_tqdm=False)
    assert tokens(reversed_outs[3]) == tokens(alone)

    # Another seed, or no seed, gives other tokens.
    other_seed = seeded.clone()
    other_seed.seed = 4321
    (different,) = llm.generate([prompt], other_seed, use_tqdm=False)
    assert tokens(different) != tokens(alone)
    unseeded_outs = llm.generate([prompt] * 4, unseeded, use_tqdm=False)
    assert len({tuple(tokens(o)) for o in unseeded_outs}) == 4


def test_seeded_requests_reproducible_inside_a_preempting_batch(llm):
    batch = mixed_batch(np.random.default_rng(5), 32, VOCAB_SIZE, max_prompt=120, max_new=24)
    params = [
        xlm.SamplingParams(temperature=1.0, seed=100 + i, max_tokens=n, ignore_eos=True)
        for i, (_, n) in enumerate(batch)
    ]
    before = num_preemptions(llm)
    outs = llm.generate([p for p, _ in batch], params, use_tqdm=False)
    assert num_preemptions(llm) > before  # some requests were recomputed from scratch
    for (prompt, _), p, out in zip(batch, params, outs):
        (alone,) = llm.generate([prompt], p, use_tqdm=False)
        assert tokens(out) == tokens(alone)


def test_seeded_n_completions_distinct_and_reproducible(llm):
    params = xlm.SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=10, ignore_eos=True)
    (first,) = llm.generate([random_prompt(12, 4)], params, use_tqdm=False)
    (second,) = llm.generate([random_prompt(12, 4)], params, use_tqdm=False)
    samples = [c.token_ids for c in first.outputs]
    assert len({tuple(t) for t in samples}) == 3
    assert [c.token_ids for c in second.outputs] == samples


# ---- 3. logprobs ----------------------------------------------------------------------


def test_logprobs_equal_log_softmax_of_transformers_logits(llm, hf_model):
    prompt = random_prompt(20, 13)
    ref = hf_greedy(hf_model, prompt, 16)
    (out,) = llm.generate([prompt], greedy(16, logprobs=5), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == ref.token_ids
    assert len(completion.logprobs) == 16
    ref_logprobs = torch.log_softmax(torch.from_numpy(ref.logits).double(), -1).numpy()
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected_top5 = np.argsort(-ref_logprobs[step], kind="stable")[:5].tolist()
        by_rank = sorted(entry, key=lambda t: entry[t].rank)
        assert by_rank[:5] == expected_top5, f"step {step}"
        assert entry[token].rank == 1  # greedy picks the most likely token
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(ref_logprobs[step, token_id], abs=1e-4)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_equal_log_softmax_of_transformers_logits(llm, hf_model):
    prompt = random_prompt(21, 100)  # longer than the step budget: chunked prefill
    params = greedy(2, prompt_logprobs=3)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    for _ in range(2):  # the second run finds the prompt in the prefix cache
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            top3 = sorted((t for t in entry if entry[t].rank <= 3), key=lambda t: entry[t].rank)
            assert top3 == np.argsort(-ref[i - 1], kind="stable")[:3].tolist()
            assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]], abs=1e-4)


# ---- 4. prefix caching ----------------------------------------------------------------


def test_prefix_cache_computes_only_new_tokens_and_output_is_unchanged(llm, tiny_path):
    block = TINY_ENGINE["block_size"]
    prefix = random_prompt(30, 4 * block)  # four full blocks
    first = prefix + random_prompt(31, 3)
    second = prefix + random_prompt(32, 5)
    params = greedy(8)
    (out_first,) = llm.generate([first], params, use_tqdm=False)
    assert out_first.num_cached_tokens == 0

    before = scheduler(llm).make_stats()
    (out_second,) = llm.generate([second], params, use_tqdm=False)
    after = scheduler(llm).make_stats()
    assert out_second.num_cached_tokens == len(prefix)
    assert after.prefix_cache_hits - before.prefix_cache_hits == len(prefix)
    # Only the 5 new prompt tokens are prefilled, then one token per decode step.
    computed = after.total_num_scheduled_tokens - before.total_num_scheduled_tokens
    assert computed == (len(second) - len(prefix)) + (params.max_tokens - 1)

    no_cache = xlm.LLM(model=tiny_path, **dict(TINY_ENGINE, enable_prefix_caching=False))
    outs = no_cache.generate([first, second], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert tokens(outs[0]) == tokens(out_first)
    assert tokens(outs[1]) == tokens(out_second)
    assert_engine_idle(llm)


# ---- 5. no compile after warm-up ------------------------------------------------------


@pytest.mark.slow
def test_num_compilations_through_the_engine_process(tiny_path, llm):
    """multiprocess=True: the count comes from the engine process, like in-process."""
    engine = xlm.LLM(model=tiny_path, multiprocess=True, **TINY_ENGINE)
    try:
        num_programs = engine.llm_engine.num_compilations
        # Same engine flags, same step programs as the in-process engine's warm-up.
        assert num_programs == WARMUP_COMPILATIONS[id(llm)]
        engine.generate([random_prompt(90, 20)], greedy(5), use_tqdm=False)
        assert engine.llm_engine.num_compilations == num_programs
    finally:
        engine.llm_engine.shutdown()


def test_no_compilation_after_warmup(llm):
    num_programs = WARMUP_COMPILATIONS[id(llm)]
    assert num_programs >= len(TINY_ENGINE["token_buckets"])  # at least one per bucket
    # Nothing compiled since warm-up, by the tests before this one either.
    assert llm.llm_engine.num_compilations == num_programs
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((1, 4, 15, 16, 17, 63, 64, 65, 200))]
    params = [
        greedy(5),
        xlm.SamplingParams(n=3, temperature=0.8, max_tokens=7),
        greedy(6, logprobs=3, prompt_logprobs=2),
        xlm.SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=1.3),
        xlm.SamplingParams(top_k=5, top_p=0.8, min_p=0.1, seed=7, max_tokens=9),
        xlm.SamplingParams(stop=["w1"], temperature=1.2, max_tokens=30),
        xlm.SamplingParams(logit_bias={7: 5.0}, min_tokens=3, max_tokens=5, seed=3),
        xlm.SamplingParams(allowed_token_ids=[10, 11, 12], bad_words=["w5"], max_tokens=4),
        xlm.SamplingParams(n=2, seed=11, logprobs=1, repetition_penalty=0.9, max_tokens=40),
    ]
    llm.generate(prompts, params, use_tqdm=False)
    for prompt, p in zip(prompts, params):  # each alone too: other batch sizes
        llm.generate([prompt], p, use_tqdm=False)
    assert llm.llm_engine.num_compilations == num_programs
    assert_engine_idle(llm)


# ---- 6. n > 1, stops and finish reasons -----------------------------------------------


def test_n_completions(llm):
    prompt = random_prompt(50, 6)
    (sampled,) = llm.generate(
        [prompt],
        xlm.SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert [c.index for c in sampled.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in sampled.outputs)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) == 4

    (single,) = llm.generate([prompt], greedy(12), use_tqdm=False)
    (greedy_n,) = llm.generate([prompt], greedy(12, n=3), use_tqdm=False)
    assert len(greedy_n.outputs) == 3
    assert all(c.token_ids == tokens(single) for c in greedy_n.outputs)
    assert all(c.text == single.outputs[0].text for c in greedy_n.outputs)


def test_stop_strings_trim_text(llm):
    prompt = random_prompt(60, 8)
    (full,) = llm.generate([prompt], greedy(20), use_tqdm=False)
    text = full.outputs[0].text
    assert full.outputs[0].finish_reason == "length"
    assert len(full.outputs[0].token_ids) == 20
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    expected = text[: text.index(stop)]

    (stopped,) = llm.generate([prompt], greedy(20, stop=[stop]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == expected
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.token_ids) < 20
    assert completion.token_ids == tokens(full)[: len(completion.token_ids)]

    (kept,) = llm.generate(
        [prompt], greedy(20, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )
    assert kept.outputs[0].text == expected + stop


def test_finish_reasons_eos_and_stop_token(llm):
    prompt = random_prompt(70, 5)
    # EOS made the greedy choice: the request ends at once with "stop".
    eos_params = xlm.SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    (eos,) = llm.generate([prompt], eos_params, use_tqdm=False)
    assert eos.outputs[0].finish_reason == "stop"
    assert eos.outputs[0].stop_reason is None
    assert eos.outputs[0].token_ids == [EOS]
    assert eos.outputs[0].text == ""

    (full,) = llm.generate([prompt], greedy(10), use_tqdm=False)
    stop_id = tokens(full)[3]
    cut = tokens(full).index(stop_id)
    (stopped,) = llm.generate([prompt], greedy(10, stop_token_ids=[stop_id]), use_tqdm=False)
    assert stopped.outputs[0].token_ids == tokens(full)[: cut + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == (
        "stop",
        stop_id,
    )


# ---- 7. the LLM API -------------------------------------------------------------------


def test_prompt_forms_agree_and_results_keep_input_order(llm):
    tokenizer = llm.get_tokenizer()
    text = "w10 w20 w30 w40"
    ids = tokenizer.encode(text)
    params = greedy(6)
    (from_text,) = llm.generate(text, params, use_tqdm=False)
    assert from_text.prompt == text
    assert from_text.prompt_token_ids == ids
    expected = tokens(from_text)
    for prompt in (ids, {"prompt_token_ids": ids}, {"prompt": text}):
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        assert out.prompt_token_ids == ids
        assert tokens(out) == expected

    texts = [f"w{i} w{i + 1}" for i in range(10, 60, 7)]
    per_prompt = [greedy(1 + i) for i in range(len(texts))]
    outs = llm.generate(texts, per_prompt, use_tqdm=False)
    assert [o.prompt for o in outs] == texts
    assert [len(tokens(o)) for o in outs] == [p.max_tokens for p in per_prompt]
    for t, o in zip(texts, outs):  # each equals its own run alone
        assert tokens(llm.generate(t, greedy(len(tokens(o))), use_tqdm=False)[0]) == tokens(o)

    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(texts, per_prompt[:-1], use_tqdm=False)
    assert_engine_idle(llm)


def test_chat_equals_generate_on_templated_ids(llm):
    tokenizer = llm.get_tokenizer()
    messages = [
        {"role": "system", "content": "w7 w8"},
        {"role": "user", "content": "w100 w101 w102"},
    ]
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(templated, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    (chat,) = llm.chat(messages, greedy(8), use_tqdm=False)
    (gen,) = llm.generate({"prompt_token_ids": ids}, greedy(8), use_tqdm=False)
    assert chat.prompt_token_ids == ids
    assert tokens(chat) == tokens(gen)
    assert chat.outputs[0].text == gen.outputs[0].text


@pytest.mark.parametrize(
    ("make_call", "match"),
    [
        (lambda llm, p: xlm.SamplingParams(temperature=-1), "temperature"),
        (lambda llm, p: xlm.SamplingParams(top_p=0), "top_p"),
        (lambda llm, p: llm.generate([[7] * 300], greedy(1), use_tqdm=False), "too long"),
        (lambda llm, p: llm.generate([[7, VOCAB_SIZE]], greedy(1), use_tqdm=False), "vocabulary"),
        (lambda llm, p: llm.generate([[7] * 250], greedy(10), use_tqdm=False), "max_tokens"),
        # A bad prompt after a good one: nothing of the call stays in the engine.
        (lambda llm, p: llm.generate([p, [-1]], greedy(4), use_tqdm=False), "vocabulary"),
        (lambda llm, p: llm.generate([], greedy(4), use_tqdm=False), "empty"),
        (lambda llm, p: llm.generate([[]], greedy(4), use_tqdm=False), "empty"),
    ],
    ids=[
        "temperature",
        "top_p",
        "prompt_too_long",
        "token_out_of_vocab",
        "max_tokens",
        "bad_second_prompt",
        "no_prompts",
        "empty_prompt",
    ],
)
def test_bad_inputs_raise_and_engine_keeps_working(llm, hf_model, make_call, match):
    prompt = random_prompt(80, 7)
    with pytest.raises(ValueError, match=match):
        make_call(llm, prompt)
    assert_engine_idle(llm)
    (out,) = llm.generate([prompt], greedy(8), use_tqdm=False)
    assert tokens(out) == hf_greedy(hf_model, prompt, 8).token_ids
    assert_engine_idle(llm)
