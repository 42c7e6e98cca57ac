"""LLaVA's processor: pixels equal transformers' CLIPImageProcessorPil (numpy + Pillow,
no torch), placeholders expanded per image, content hashes by pixels."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoConfig, CLIPImageProcessorPil

from tests.multimodal_fixtures import IMAGE_SIZE, TOKENS_PER_IMAGE, make_image
from xlm.engine.exceptions import RequestValidationError
from xlm.multimodal.image import MediaPolicy
from xlm.multimodal.processing import (
    CLIPImagePreprocessor,
    content_hash,
    get_mm_processor,
    read_preprocessor_config,
)


@pytest.mark.parametrize(
    "size, crop, width, height",
    [
        ({"shortest_edge": 28}, 28, 40, 33),  # landscape
        ({"shortest_edge": 28}, 28, 31, 57),  # portrait
        ({"shortest_edge": 32}, 28, 300, 200),  # downscale, crop inside
        ({"height": 30, "width": 30}, 28, 64, 48),  # fixed resize
        ({"shortest_edge": 20}, 28, 50, 40),  # crop larger than the resized image: padded
    ],
)
def test_pixels_equal_transformers(size, crop, width, height):
    reference = CLIPImageProcessorPil(size=size, crop_size={"height": crop, "width": crop})
    image = make_image(width * height, width, height)
    want = reference(image, return_tensors="np")["pixel_values"][0]
    got = CLIPImagePreprocessor(reference.to_dict())(image)
    assert got.shape == want.shape == (3, crop, crop)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_placeholders_expand_per_image_with_features(tiny_llava):
    config = AutoConfig.from_pretrained(tiny_llava)
    processor = get_mm_processor(config, tiny_llava, MediaPolicy())
    assert read_preprocessor_config(tiny_llava)["crop_size"]["height"] == IMAGE_SIZE
    mark = config.image_token_index
    images = [make_image(0), make_image(1)]
    ids, features = processor.process([5, mark, 6, mark, 7], images)
    n = TOKENS_PER_IMAGE
    assert ids == [5] + [mark] * n + [6] + [mark] * n + [7]
    assert [(f.offset, f.length) for f in features] == [(1, n), (2 + n, n)]
    assert features[0].pixel_values.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    assert features[0].identifier != features[1].identifier
    again, _ = processor.process([mark], [make_image(0)])
    assert processor.process([mark], [make_image(0)])[1][0].identifier == features[0].identifier
    assert len(again) == n
    with pytest.raises(
        RequestValidationError, match=r"1 image placeholders \(token id \d+\) for 2 images"
    ):
        processor.process([mark], images)


def test_content_hash_is_by_pixels():
    a = np.zeros((3, 2, 2), np.float32)
    b = a.copy()
    b[0, 0, 0] = 1
    assert content_hash("image", a) == content_hash("image", a.copy())
    assert content_hash("image", a) != content_hash("image", b)
    assert content_hash("image", a) != content_hash("image", a.reshape(3, 4, 1))


def test_text_only_checkpoints_have_no_processor():
    assert get_mm_processor(AutoConfig.for_model("llama"), "/nonexistent") is None


@pytest.mark.parametrize(
    "size, width, height",
    [(28, 40, 33), (28, 31, 57), (56, 300, 200), (896, 64, 48)],
)
def test_gemma3_pixels_equal_transformers(size, width, height):
    from types import SimpleNamespace

    from transformers import Gemma3ImageProcessorPil

    from xlm.multimodal.processing import Gemma3Processor

    reference = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    hf_config = SimpleNamespace(
        vision_config=SimpleNamespace(image_size=size),
        image_token_index=9,
        boi_token_index=7,
        eoi_token_index=8,
        mm_tokens_per_image=4,
    )
    processor = Gemma3Processor(hf_config, "/nonexistent", MediaPolicy())
    processor.preprocess = CLIPImagePreprocessor(
        {"resample": 2} | reference.to_dict() | {"do_center_crop": False}
    )
    image = make_image(width * height, width, height)
    want = reference(image, return_tensors="np")["pixel_values"][0]
    got = processor.pixels(image)
    assert got.shape == want.shape == (3, size, size)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_gemma3_expansion_equals_transformers_processor(tiny_gemma3):
    from transformers import AutoTokenizer

    from tests.multimodal_fixtures import gemma3_reference_inputs

    config = AutoConfig.from_pretrained(tiny_gemma3)
    processor = get_mm_processor(config, tiny_gemma3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3)
    prompt = "<bos>w1 <start_of_image> w2 w3 <start_of_image> w4"
    images = [make_image(1), make_image(2, 50, 30)]
    ids, features = processor.process(tokenizer.encode(prompt, add_special_tokens=False), images)
    want = gemma3_reference_inputs(tiny_gemma3, prompt, images)
    assert ids == want["input_ids"][0].tolist()
    image_positions = [i for i, t in enumerate(want["token_type_ids"][0].tolist()) if t == 1]
    assert [p for f in features for p in range(f.offset, f.end)] == image_positions
    for feature, pixels in zip(features, want["pixel_values"].numpy(), strict=True):
        np.testing.assert_allclose(feature.pixel_values, pixels, atol=1e-5)


def test_gemma3_newline_runs_merge():
    from types import SimpleNamespace

    from xlm.multimodal.processing import Gemma3Processor

    hf_config = SimpleNamespace(
        vision_config=SimpleNamespace(image_size=28),
        image_token_index=9,
        boi_token_index=7,
        eoi_token_index=8,
        mm_tokens_per_image=2,
    )
    processor = Gemma3Processor(hf_config, "/nonexistent", MediaPolicy())
    processor.newlines = {1: 101, 2: 102, 3: 103}  # "\n", "\n\n", "\n\n\n" token ids
    processor.run_of = {v: k for k, v in processor.newlines.items()}
    ids, _ = processor.process([5, 101, 7, 101, 6], [make_image(0)])
    # "\n" + "\n\n" -> "\n\n\n" on both sides, as the tokenizer would merge them.
    assert ids == [5, 103, 7, 9, 9, 8, 103, 6]
