"""/v1/completions over the stand-in engine (it answers each prompt's tokens in a cycle):
choices per prompt and n, echo, logprobs, usage, and the stream equal to the whole
response, each read by the official openai client (the real engine:
tests/e2e/test_server.py)."""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.test_api_server import MODEL, make_client

PROMPTS = ["The capital of France is", "One two three"]


@pytest.fixture(scope="module")
def oai(tokenizer):
    """The openai client over the app in this process (no socket)."""
    with make_client(tokenizer, "--max-n", "4") as http:
        yield openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=http)


def _expected_text(tokenizer, prompt: str, j: int, max_tokens: int) -> str:
    """What the stand-in engine generates for sample j: the prompt's tokens from j on."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return "".join(tokenizer.decode([ids[(s + j) % len(ids)]]) for s in range(max_tokens))


def _num_tokens(tokenizer, prompts: list[str]) -> int:
    return sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)


def test_choices_are_indexed_by_prompt_then_sample_with_usage(oai, tokenizer):
    completion = oai.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=3, seed=1)
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    for choice in completion.choices:
        prompt, j = PROMPTS[choice.index // 2], choice.index % 2
        assert choice.text == _expected_text(tokenizer, prompt, j, 3)
        assert choice.finish_reason == "length" and choice.logprobs is None
    prompt_tokens = _num_tokens(tokenizer, PROMPTS)
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.completion_tokens == 4 * 3
    assert completion.usage.total_tokens == prompt_tokens + 12


def test_echo_with_logprobs_puts_the_prompt_first(oai, tokenizer):
    prompt = PROMPTS[0]
    completion = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1
    )
    (choice,) = completion.choices
    assert choice.text == prompt + _expected_text(tokenizer, prompt, 0, 2)
    logprobs = choice.logprobs
    n = _num_tokens(tokenizer, [prompt])
    assert len(logprobs.tokens) == n + 2
    assert "".join(logprobs.tokens) == choice.text
    # The stand-in engine computes no prompt logprobs: null, as OpenAI's first echoed token.
    assert logprobs.token_logprobs == [None] * n + [-0.5, -0.5]
    assert logprobs.top_logprobs[:n] == [None] * n
    tops = zip(logprobs.tokens[n:], logprobs.top_logprobs[n:])
    assert all(top == {tok: -0.5} for tok, top in tops), logprobs.top_logprobs
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(n + 2)]
    assert logprobs.text_offset == offsets


def test_the_stream_adds_up_to_the_whole_response(oai):
    request = dict(model=MODEL, prompt=PROMPTS, n=2, max_tokens=4, echo=True)
    whole = oai.completions.create(**request)
    chunks = list(
        oai.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.id == chunks[0].id and chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {i: "length" for i in range(4)}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_token_id_prompts_run_and_one_past_the_context_is_a_400(oai):
    completion = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:  # the stand-in's context is 64
        oai.completions.create(model=MODEL, prompt=[5] * 60, max_tokens=10)
    assert e.value.status_code == 400 and "64" in e.value.message
