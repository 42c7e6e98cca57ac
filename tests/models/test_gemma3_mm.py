"""Gemma 3 with images through LLM.generate and LLM.chat: greedy tokens equal
transformers' (its processor's expansion and its bidirectional mask over each image's
tokens), the encoder cache shared, prompt tokens counting the image tokens, no compile
after warm-up, and TP=2."""

from __future__ import annotations

import pytest

import xlm
from tests.multimodal_fixtures import (
    GEMMA3_TOKENS_PER_IMAGE,
    gemma3_transformers_greedy,
    generate_sharing_one_image,
    generate_with_images,
    generate_with_tensor_parallel,
    make_blocky_image,
)

MAX_TOKENS = 6
GREEDY = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def _prompt(*middle: str) -> str:
    return "<bos><start_of_turn> user " + " ".join(middle) + " <end_of_turn> <start_of_turn> model"


def _run(llm, prompt: str, images: list) -> xlm.RequestOutput:
    return generate_with_images(llm, prompt, images, GREEDY)


def _check(llm, path: str, prompt: str, images: list, out: xlm.RequestOutput) -> None:
    want, want_ids = gemma3_transformers_greedy(path, prompt, images, MAX_TOKENS)
    # The prompt as the model sees it: transformers' processor's expansion.
    assert list(out.prompt_token_ids) == want_ids
    assert list(out.outputs[0].token_ids) == want


def test_one_image_equals_transformers(tiny_gemma3_llm, tiny_gemma3):
    prompt = _prompt("w5 <start_of_image>", "w9 w13")
    outs = {}
    for seed in (0, 1):
        image = make_blocky_image(seed)
        out = _run(tiny_gemma3_llm, prompt, [image])
        _check(tiny_gemma3_llm, tiny_gemma3, prompt, [image], out)
        # boi, the image tokens, eoi and two "\n\n" for the one placeholder.
        n_text = len(tiny_gemma3_llm.get_tokenizer().encode(prompt, add_special_tokens=False))
        assert len(out.prompt_token_ids) == n_text + GEMMA3_TOKENS_PER_IMAGE + 3
        outs[seed] = list(out.outputs[0].token_ids)
    assert outs[0] != outs[1], "the image does not change the output"
    # The image tokens' bidirectional attention matters here: causal-only attention
    # (transformers without token_type_ids) gives other tokens.
    causal, _ = gemma3_transformers_greedy(
        tiny_gemma3, prompt, [make_blocky_image(1)], MAX_TOKENS, bidirectional=False
    )
    assert causal != outs[1]


def test_two_images_equal_transformers(tiny_gemma3_llm, tiny_gemma3):
    prompt = _prompt("w3 <start_of_image> w4", "<start_of_image> w8")
    images = [make_blocky_image(2), make_blocky_image(3, 50, 30)]
    for order in (images, images[::-1]):
        _check(tiny_gemma3_llm, tiny_gemma3, prompt, order, _run(tiny_gemma3_llm, prompt, order))


def test_shared_image_is_encoded_once(tiny_gemma3_llm, tiny_gemma3):
    image = make_blocky_image(4)
    prompts = [_prompt("<start_of_image>", "w10 w11"), _prompt("w20 <start_of_image>", "w21 w22")]
    outs = generate_sharing_one_image(tiny_gemma3_llm, prompts, image, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        _check(tiny_gemma3_llm, tiny_gemma3, prompt, [image], out)


def test_image_is_not_cut_by_chunked_prefill(tiny_gemma3_llm, tiny_gemma3):
    # 57 words first: the step budget (64 tokens) would end inside the image's tokens
    # which attend to each other both ways: the chunk is cut before the image instead.
    words = " ".join(f"w{i}" for i in range(30, 87))
    prompt = _prompt(words, "<start_of_image>", "w90 w91")
    image = make_blocky_image(5)
    _check(tiny_gemma3_llm, tiny_gemma3, prompt, [image], _run(tiny_gemma3_llm, prompt, [image]))


def test_chat_equals_transformers(tiny_gemma3_llm, tiny_gemma3):
    image = make_blocky_image(6)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "w7 w8"},
                {"type": "image_pil", "image_pil": image},
                {"type": "text", "text": "w9"},
            ],
        }
    ]
    out = tiny_gemma3_llm.chat(messages, GREEDY, use_tqdm=False)[0]
    prompt = (
        "<bos><start_of_turn> user w7 w8 <start_of_image> w9 <end_of_turn> <start_of_turn> model "
    )
    _check(tiny_gemma3_llm, tiny_gemma3, prompt, [image], out)


def test_no_compilation_after_warmup(tiny_gemma3_llm):
    compiled = tiny_gemma3_llm.llm_engine.num_compilations
    prompts = [
        {
            "prompt": _prompt("<start_of_image>", "w7"),
            "multi_modal_data": {"image": make_blocky_image(10)},
        },
        {
            "prompt": _prompt("<start_of_image> w1 <start_of_image>"),
            "multi_modal_data": {"image": [make_blocky_image(11), make_blocky_image(12)]},
        },
        _prompt("w1 w2 w3"),
    ]
    tiny_gemma3_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tiny_gemma3_llm.llm_engine.num_compilations == compiled


@pytest.mark.slow
def test_tensor_parallel(tiny_gemma3, tmp_path):
    """TP=2 on fake CPU devices: tokens equal transformers', nothing compiled after warm-up."""
    prompt = _prompt("w5 <start_of_image>", "w9 w13")
    result = generate_with_tensor_parallel(tiny_gemma3, prompt, "make_blocky_image", [[0], [1]], 8)
    want = [
        gemma3_transformers_greedy(tiny_gemma3, prompt, [make_blocky_image(s)], 6)[0]
        for s in (0, 1)
    ]
    assert result["tokens"] == want
    assert result["compiled_after_warmup"] == 0


def test_encode_images_equals_transformers(tiny_gemma3):
    """The SigLIP tower and Gemma 3's projector (pooling, norm, projection) alone."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import Gemma3ForConditionalGeneration as HFGemma3
    from transformers import Gemma3ImageProcessorPil

    from xlm.models.gemma3_mm import Gemma3ForConditionalGeneration
    from xlm.models.loader import build_abstract_model, load_hf_config, load_weights
    from xlm.models.loader.safetensors_format import iter_safetensors_tensors

    config = load_hf_config(tiny_gemma3)
    model = build_abstract_model(Gemma3ForConditionalGeneration, config, jnp.float32)
    model = load_weights(model, iter_safetensors_tensors(tiny_gemma3), dtype=jnp.float32)
    processor = Gemma3ImageProcessorPil.from_pretrained(tiny_gemma3)
    images = [make_blocky_image(0), make_blocky_image(1, 60, 20)]
    pixels = processor(images, return_tensors="np")["pixel_values"]
    hf = HFGemma3.from_pretrained(tiny_gemma3).eval()
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=torch.tensor(np.asarray(pixels)))
    want = want.pooler_output.numpy()
    got = np.asarray(model.encode_images(jnp.asarray(pixels)))
    assert got.shape == (2, GEMMA3_TOKENS_PER_IMAGE, config.text_config.hidden_size)
    np.testing.assert_allclose(got, want, atol=1e-4)
