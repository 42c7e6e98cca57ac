"""Qwen2-VL and Qwen2.5-VL through LLM.generate and LLM.chat: greedy tokens equal
transformers' (one image, two images of different sizes, an image shared by requests, an
image cut by chunked prefill),
usage counting the image tokens, no compile after warm-up, and TP=2 on fake devices."""

from __future__ import annotations

import numpy as np
import pytest

import xlm
from tests.engine.reference import TINY_ENGINE
from tests.multimodal_fixtures import (
    generate_sharing_one_image,
    generate_with_images,
    generate_with_tensor_parallel,
    make_image,
)
from tests.qwen2_vl_fixtures import IMAGE_PART, MERGE_SIZE, transformers_greedy

MAX_TOKENS = 6
GREEDY = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
# Images of different sizes (so different token counts and patch buckets).
SIZES = [(40, 33), (20, 30), (64, 24), (50, 50)]


@pytest.fixture(scope="module")
def qwen_vl_llm(tiny_qwen_vl):
    """One engine per family for the module (every program compiled at start-up)."""
    return xlm.LLM(model=tiny_qwen_vl, **dict(TINY_ENGINE, max_model_len=256))


def _prompt(*middle: str) -> str:
    return "<|im_start|> user " + " ".join(middle) + " <|im_end|> <|im_start|> assistant"


def _run(llm, prompt: str, images: list) -> xlm.RequestOutput:
    return generate_with_images(llm, prompt, images, GREEDY)


def _tokens(image) -> int:
    """Tokens of an image after transformers' smart_resize (the reference's count)."""
    from tests.qwen2_vl_fixtures import image_processor

    out = image_processor(8 * 8 * 4, 8 * 8 * 36)([image], return_tensors="np")
    return int(np.prod(out["image_grid_thw"][0])) // MERGE_SIZE**2


def _reference(llm, path: str, prompt: str, images: list) -> list[int]:
    ids = llm.get_tokenizer().encode(prompt)
    return transformers_greedy(path, ids, images, MAX_TOKENS)


def test_one_image_equals_transformers(qwen_vl_llm, tiny_qwen_vl):
    prompt = _prompt(IMAGE_PART, "w5 w9 w13")
    outs = {}
    for seed in (0, 1):
        image = make_image(seed)
        out = _run(qwen_vl_llm, prompt, [image])
        want = _reference(qwen_vl_llm, tiny_qwen_vl, prompt, [image])
        assert list(out.outputs[0].token_ids) == want
        # The prompt as the model sees it: the placeholder expanded to the image's tokens.
        n_text = len(qwen_vl_llm.get_tokenizer().encode(prompt))
        assert len(out.prompt_token_ids) == n_text - 1 + _tokens(image)
        outs[seed] = want
    assert outs[0] != outs[1], "the image does not change the output"


def test_two_images_of_different_sizes(qwen_vl_llm, tiny_qwen_vl):
    prompt = _prompt("w3", IMAGE_PART, "w4", IMAGE_PART, "w8")
    images = [make_image(2, *SIZES[1]), make_image(3, *SIZES[2])]
    assert _tokens(images[0]) != _tokens(images[1])
    for pair in (images, images[::-1]):
        out = _run(qwen_vl_llm, prompt, pair)
        assert list(out.outputs[0].token_ids) == _reference(qwen_vl_llm, tiny_qwen_vl, prompt, pair)


def test_shared_image_is_encoded_once(qwen_vl_llm, tiny_qwen_vl):
    image = make_image(4, *SIZES[3])
    prompts = [_prompt(IMAGE_PART, "w10 w11"), _prompt("w20", IMAGE_PART, "w21 w22 w23")]
    outs = generate_sharing_one_image(qwen_vl_llm, prompts, image, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _reference(
            qwen_vl_llm, tiny_qwen_vl, prompt, [image]
        )


def test_image_cut_by_chunked_prefill(qwen_vl_llm, tiny_qwen_vl):
    # 50 words first: the step budget (64 tokens) ends inside the image's placeholders,
    # so the second chunk's M-RoPE positions start mid-image.
    words = " ".join(f"w{i}" for i in range(30, 80))
    prompt = _prompt(words, IMAGE_PART, "w90 w91")
    image = make_image(5, *SIZES[3])
    before = qwen_vl_llm.llm_engine.encoder_cache_stats()
    out = _run(qwen_vl_llm, prompt, [image])
    after = qwen_vl_llm.llm_engine.encoder_cache_stats()
    assert list(out.outputs[0].token_ids) == _reference(qwen_vl_llm, tiny_qwen_vl, prompt, [image])
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] - before["hits"] == 1


def test_chat_equals_transformers(qwen_vl_llm, tiny_qwen_vl):
    image = make_image(8, *SIZES[0])
    pil = {"type": "image_pil", "image_pil": image}
    messages = [{"role": "user", "content": [pil, {"type": "text", "text": "w1 w2"}]}]
    out = qwen_vl_llm.chat(messages, GREEDY, use_tqdm=False)[0]
    prompt = "<|im_start|> user " + IMAGE_PART + " w1 w2 <|im_end|> <|im_start|> assistant"
    assert list(out.outputs[0].token_ids) == _reference(qwen_vl_llm, tiny_qwen_vl, prompt, [image])


def test_no_compilation_after_warmup(qwen_vl_llm):
    compiled = qwen_vl_llm.llm_engine.num_compilations
    prompts = [
        {"prompt": _prompt(IMAGE_PART, "w7"), "multi_modal_data": {"image": make_image(10)}},
        {
            "prompt": _prompt(IMAGE_PART, "w1", IMAGE_PART),
            "multi_modal_data": {"image": [make_image(11, 8, 8), make_image(12, 90, 90)]},
        },
        {
            "prompt": _prompt(IMAGE_PART, IMAGE_PART, IMAGE_PART),
            "multi_modal_data": {"image": [make_image(13 + i, *SIZES[i]) for i in range(3)]},
        },
        _prompt("w1 w2 w3"),
    ]
    qwen_vl_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert qwen_vl_llm.llm_engine.num_compilations == compiled


@pytest.mark.slow
def test_tensor_parallel(tiny_qwen_vl, tmp_path):
    """TP=2 on CPU devices: the decoder sharded, the vision transformer and the encoder
    cache replicated; tokens equal transformers', nothing compiled after warm-up."""
    if "qwen2_5_vl" not in tiny_qwen_vl:
        pytest.skip("one family under TP is enough (Qwen2.5-VL: windows and full layers)")
    prompt = _prompt(IMAGE_PART, "w5 w9 w13")
    image_args = [[s, 40 + 10 * s, 33] for s in (0, 1)]
    result = generate_with_tensor_parallel(tiny_qwen_vl, prompt, "make_image", image_args, 8)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_qwen_vl).encode(prompt)
    images = [make_image(s, 40 + 10 * s, 33) for s in (0, 1)]
    want = [transformers_greedy(tiny_qwen_vl, ids, [im], 6) for im in images]
    assert result["tokens"] == want
    assert result["compiled_after_warmup"] == 0


def test_outer_config_ties_the_embeddings():
    from flax import nnx

    from tests.qwen2_vl_fixtures import _configs
    from xlm.models.qwen2_vl import Qwen2VLForConditionalGeneration

    config = _configs(False)
    config.tie_word_embeddings = True
    config.text_config.tie_word_embeddings = False
    model = Qwen2VLForConditionalGeneration(config, rngs=nnx.Rngs(0))
    assert model.lm_head is None
    # A checkpoint's lm_head copy (if any) is skipped, not loaded.
    assert model.hf_weight_targets("lm_head.weight", {})[0].param == ""


@pytest.fixture(scope="module")
def real_pixels_qwen_vl(tmp_path_factory):
    """A tiny Qwen2.5-VL whose preprocessor_config.json is in the real checkpoints' form
    with their default max_pixels (12845056: 200704 tokens an image at patch 4)."""
    from tests.qwen2_vl_fixtures import write_real_style_processor_config, write_tiny_qwen_vl

    path = str(tmp_path_factory.mktemp("real_pixels") / "qwen2_5_vl")
    return write_real_style_processor_config(write_tiny_qwen_vl(path, v25=True))


# Big enough that the real default would keep more tokens than the cap (90x90: 121).
CAP_SIZES = [(90, 90), (120, 40), (40, 33)]


def _generate_equals_transformers(llm, path: str, processor_kwargs: dict) -> list[int]:
    """Each CAP_SIZES image alone, then two in one prompt: greedy ids equal transformers'
    given `processor_kwargs`, nothing compiled after warm-up; each prompt's image tokens."""
    compiled = llm.llm_engine.num_compilations
    images = [make_image(30 + i, *size) for i, size in enumerate(CAP_SIZES)]
    cases = [(_prompt(IMAGE_PART, "w5 w9"), [image]) for image in images]
    cases.append((_prompt("w3", IMAGE_PART, "w4", IMAGE_PART), images[:2]))
    lengths = []
    for prompt, pair in cases:
        out = _run(llm, prompt, pair)
        ids = llm.get_tokenizer().encode(prompt)
        want = transformers_greedy(path, ids, pair, MAX_TOKENS, processor_kwargs)
        assert list(out.outputs[0].token_ids) == want, (prompt, [im.size for im in pair])
        lengths.append(len(out.prompt_token_ids) - len(ids) + len(pair))
    assert llm.llm_engine.num_compilations == compiled
    return lengths


def test_real_default_max_pixels_is_capped_to_the_step_budget(real_pixels_qwen_vl):
    """The checkpoint's max_pixels would make an encoder bucket of 802816 patches; the
    engine caps it to max_num_batched_tokens' worth (64 tokens: 64 * 8^2 pixels), and its
    outputs equal transformers' processor given that max_pixels."""
    llm = xlm.LLM(model=real_pixels_qwen_vl, **TINY_ENGINE)
    capped = 64 * (4 * MERGE_SIZE) ** 2
    assert llm.llm_engine.config.model_config.mm_processor_config["max_pixels"] == capped
    image_tokens = _generate_equals_transformers(llm, real_pixels_qwen_vl, {"max_pixels": capped})
    assert image_tokens[0] == 64  # 90x90 capped (121 tokens under the checkpoint's limit)


def test_mm_processor_kwargs_reach_the_engine(real_pixels_qwen_vl):
    """LLM(mm_processor_kwargs=...) sets the pixels the engine and transformers both use."""
    kwargs = {"max_pixels": 20 * (4 * MERGE_SIZE) ** 2, "min_pixels": 12 * (4 * MERGE_SIZE) ** 2}
    llm = xlm.LLM(model=real_pixels_qwen_vl, mm_processor_kwargs=kwargs, **TINY_ENGINE)
    image_tokens = _generate_equals_transformers(llm, real_pixels_qwen_vl, kwargs)
    assert all(12 <= n <= 20 for n in image_tokens[:-1])  # one image a prompt


def test_bad_mm_processor_kwargs_fail_at_construction(real_pixels_qwen_vl):
    with pytest.raises(ValueError, match="key 'max_pixel' .* allowed min_pixels, max_pixels"):
        xlm.LLM(model=real_pixels_qwen_vl, mm_processor_kwargs={"max_pixel": 4096})
