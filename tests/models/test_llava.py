"""LLaVA-1.5 through LLM.generate with multi_modal_data: greedy tokens equal transformers'
(one image, two images, an image shared by requests, an image cut by chunked prefill, the
prefix cache keyed by image), the encoder cache counted, no compile after warm-up."""

from __future__ import annotations

import pytest

import xlm
from tests.multimodal_fixtures import (
    TOKENS_PER_IMAGE,
    generate_sharing_one_image,
    generate_with_images,
    generate_with_tensor_parallel,
    make_image,
    transformers_greedy,
)
from xlm.engine.exceptions import RequestValidationError

MAX_TOKENS = 6
GREEDY = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def _prompt(*middle: str) -> str:
    return "<|im_start|> user " + " ".join(middle) + " <|im_end|> <|im_start|> assistant"


def _run(llm, prompt: str, images: list) -> xlm.RequestOutput:
    return generate_with_images(llm, prompt, images, GREEDY)


def _reference(llm, path: str, prompt: str, images: list) -> list[int]:
    ids = llm.get_tokenizer().encode(prompt)
    return transformers_greedy(path, ids, images, MAX_TOKENS)


def test_one_image_equals_transformers(tiny_llava_llm, tiny_llava):
    prompt = _prompt("<image>", "w5 w9 w13")
    outs = {}
    for seed in (0, 1):
        image = make_image(seed)
        out = _run(tiny_llava_llm, prompt, [image])
        assert list(out.outputs[0].token_ids) == _reference(
            tiny_llava_llm, tiny_llava, prompt, [image]
        )
        # The prompt as the model sees it: the placeholder expanded.
        assert len(out.prompt_token_ids) == len(tiny_llava_llm.get_tokenizer().encode(prompt)) + (
            TOKENS_PER_IMAGE - 1
        )
        outs[seed] = list(out.outputs[0].token_ids)
    assert outs[0] != outs[1], "the image does not change the output"


def test_two_images_equal_transformers(tiny_llava_llm, tiny_llava):
    prompt = _prompt("w3 <image> w4", "<image> w8")
    images = [make_image(2), make_image(3, 50, 30)]
    out = _run(tiny_llava_llm, prompt, images)
    assert list(out.outputs[0].token_ids) == _reference(tiny_llava_llm, tiny_llava, prompt, images)
    swapped = _run(tiny_llava_llm, prompt, images[::-1])
    assert list(swapped.outputs[0].token_ids) == _reference(
        tiny_llava_llm, tiny_llava, prompt, images[::-1]
    )


def test_shared_image_is_encoded_once(tiny_llava_llm, tiny_llava):
    image = make_image(4)
    prompts = [_prompt("<image>", "w10 w11"), _prompt("w20 <image>", "w21 w22 w23")]
    outs = generate_sharing_one_image(tiny_llava_llm, prompts, image, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _reference(
            tiny_llava_llm, tiny_llava, prompt, [image]
        )


def test_image_cut_by_chunked_prefill(tiny_llava_llm, tiny_llava):
    # 50 words first: the step budget (64 tokens) ends inside the image's 16 placeholders.
    words = " ".join(f"w{i}" for i in range(30, 80))
    prompt = _prompt(words, "<image>", "w90 w91")
    image = make_image(5)
    before = tiny_llava_llm.llm_engine.encoder_cache_stats()
    out = _run(tiny_llava_llm, prompt, [image])
    after = tiny_llava_llm.llm_engine.encoder_cache_stats()
    assert list(out.outputs[0].token_ids) == _reference(tiny_llava_llm, tiny_llava, prompt, [image])
    # Encoded for the first chunk, read from the cache by the second.
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] - before["hits"] == 1


def test_prefix_cache_is_keyed_by_image(tiny_llava_llm, tiny_llava):
    # The image fills the first block (2 + 16 tokens >= block_size 16).
    prompt = _prompt("<image>", "w40 w41 w42")
    first, other = make_image(6), make_image(7)
    _run(tiny_llava_llm, prompt, [first])
    again = _run(tiny_llava_llm, prompt, [first])
    assert again.num_cached_tokens >= 16  # the same image: its blocks are reused
    out = _run(tiny_llava_llm, prompt, [other])
    assert out.num_cached_tokens == 0  # another image: no block of the first is reused
    assert list(out.outputs[0].token_ids) == _reference(tiny_llava_llm, tiny_llava, prompt, [other])


@pytest.mark.parametrize(
    "prompt, images, match",
    [
        (_prompt("w1 w2"), [make_image(0)], "0 image placeholders"),
        (_prompt("<image> <image>"), [make_image(0)], "2 image placeholders"),
        (_prompt("<image>"), ["not an image"], "expected a PIL.Image"),
    ],
)
def test_bad_image_inputs_are_refused(tiny_llava_llm, prompt, images, match):
    with pytest.raises(RequestValidationError, match=match):
        _run(tiny_llava_llm, prompt, images)
    assert _run(tiny_llava_llm, _prompt("<image>"), [make_image(0)]).outputs[0].token_ids


def test_no_compilation_after_warmup(tiny_llava_llm):
    compiled = tiny_llava_llm.llm_engine.num_compilations
    prompts = [
        {"prompt": _prompt("<image>", "w7"), "multi_modal_data": {"image": make_image(10)}},
        {
            "prompt": _prompt("<image> w1 <image>"),
            "multi_modal_data": {"image": [make_image(11), make_image(12)]},
        },
        {
            "prompt": _prompt("<image> <image> <image>"),
            "multi_modal_data": {"image": [make_image(13), make_image(14), make_image(15)]},
        },
        _prompt("w1 w2 w3"),
    ]
    tiny_llava_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tiny_llava_llm.llm_engine.num_compilations == compiled


@pytest.mark.slow
def test_tensor_parallel_replicates_the_encoder(tiny_llava, tmp_path):
    """TP=2 on two CPU devices: the decoder sharded, the vision tower and the encoder
    cache replicated; tokens equal transformers', nothing compiled after warm-up."""
    prompt = _prompt("<image>", "w5 w9 w13")
    result = generate_with_tensor_parallel(tiny_llava, prompt, "make_image", [[0], [1]], 2)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llava).encode(prompt)
    want = [transformers_greedy(tiny_llava, ids, [make_image(s)], 6) for s in (0, 1)]
    assert result["tokens"] == want
    assert result["compiled_after_warmup"] == 0
