"""The engine's preprocessor config: mm_processor_kwargs over the checkpoint's (pixels and
grids equal transformers' processor given the same kwargs), clear errors for a bad key
or value, and the cap on Qwen2-VL's max_pixels that every size derived from it follows."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from tests.multimodal_fixtures import make_image
from tests.qwen2_vl_fixtures import (
    MAX_PIXELS,
    MERGE_SIZE,
    MIN_PIXELS,
    PATCH_SIZE,
    REAL_MAX_PIXELS,
    image_processor,
    write_real_style_processor_config,
)
from xlm.config import ModelConfig, SchedulerConfig, XlmConfig
from xlm.multimodal.budget import encoder_cache_slots, tokens_per_image
from xlm.multimodal.processor_config import (
    apply_mm_processor_kwargs,
    check_mm_processor_kwargs,
    fit_max_pixels,
    read_preprocessor_config,
    resolve_processor_config,
)
from xlm.multimodal.qwen2_vl import Qwen2VLImagePreprocessor

FACTOR = PATCH_SIZE * MERGE_SIZE
_VISION = SimpleNamespace(patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE)
QWEN = SimpleNamespace(model_type="qwen2_vl", vision_config=_VISION)
LLAVA = SimpleNamespace(model_type="llava", vision_config=SimpleNamespace())
GEMMA3 = SimpleNamespace(model_type="gemma3", vision_config=SimpleNamespace())
TEXT = SimpleNamespace(model_type="llama")


@pytest.fixture
def real_style_dir(tmp_path):
    """A directory whose preprocessor_config.json is in the real checkpoints' form."""
    path = tmp_path / "real"
    path.mkdir()
    return write_real_style_processor_config(str(path))


@pytest.fixture
def size_style_dir(tmp_path):
    """A directory whose preprocessor_config.json spells its limits in `size`."""
    path = str(tmp_path / "size")
    image_processor(MIN_PIXELS, MAX_PIXELS).save_pretrained(path)
    return path


def _ours_and_transformers(model_dir, ours_kwargs, hf_kwargs, image):
    from transformers import Qwen2VLImageProcessorPil

    config = apply_mm_processor_kwargs(QWEN, read_preprocessor_config(model_dir), ours_kwargs)
    patches, grid = Qwen2VLImagePreprocessor(config)(image)
    want = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **hf_kwargs)(
        [image], return_tensors="np"
    )
    return (patches, grid), (want["pixel_values"], want["image_grid_thw"][0])


@pytest.mark.parametrize(
    "style, kwargs, size",
    [
        ("real", {"max_pixels": FACTOR**2 * 12}, (90, 70)),  # shrunk below the config's max
        ("real", {"min_pixels": FACTOR**2 * 30, "max_pixels": FACTOR**2 * 40}, (20, 16)),
        ("size", {"max_pixels": FACTOR**2 * 50}, (80, 80)),  # above the config's 36 tokens
    ],
)
def test_pixel_kwargs_equal_transformers(real_style_dir, size_style_dir, style, kwargs, size):
    model_dir = real_style_dir if style == "real" else size_style_dir
    image = make_image(sum(size), *size)
    (patches, grid), (want, want_grid) = _ours_and_transformers(model_dir, kwargs, kwargs, image)
    assert list(grid) == list(want_grid)
    np.testing.assert_allclose(patches, want, atol=1e-5)
    # The override changed the grid: without it the checkpoint's limits give another one.
    _, default_grid = Qwen2VLImagePreprocessor(read_preprocessor_config(model_dir))(image)
    assert list(default_grid) != list(grid)


def test_size_kwarg_merges_into_the_configs_size(size_style_dir):
    image = make_image(3, 90, 70)
    longest = FACTOR**2 * 12
    # Only longest_edge given: the config's shortest_edge stays (vLLM's merge); the
    # reference is handed the merged dict, as transformers replaces `size` whole.
    (patches, grid), (want, want_grid) = _ours_and_transformers(
        size_style_dir,
        {"size": {"longest_edge": longest}},
        {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": longest}},
        image,
    )
    assert list(grid) == list(want_grid) and np.prod(grid) // MERGE_SIZE**2 <= 12
    np.testing.assert_allclose(patches, want, atol=1e-5)


def test_the_override_is_written_in_both_spellings(size_style_dir):
    config = apply_mm_processor_kwargs(
        QWEN, read_preprocessor_config(size_style_dir), {"max_pixels": 4096}
    )
    assert config["max_pixels"] == config["size"]["longest_edge"] == 4096
    assert config["min_pixels"] == config["size"]["shortest_edge"] == MIN_PIXELS


@pytest.mark.parametrize(
    "hf_config, kwargs, match",
    [
        (QWEN, {"max_pixel": 4096}, r"key 'max_pixel' .* allowed min_pixels, max_pixels, size"),
        (LLAVA, {"max_pixels": 4096}, r"key 'max_pixels' .* llava.* allowed none"),
        (TEXT, {"max_pixels": 4096}, r"llama.* allowed none \(the model takes no images\)"),
        (GEMMA3, {"size": {}}, r"key 'size' .* allowed do_pan_and_scan"),
        (QWEN, {"max_pixels": 0}, r"max_pixels=0 is invalid: allowed a positive integer"),
        (QWEN, {"max_pixels": "4096"}, r"max_pixels='4096' is invalid"),
        (QWEN, {"min_pixels": True}, r"min_pixels=True is invalid"),
        (QWEN, {"size": {"height": 4}}, r"size=.* allowed a dict with shortest_edge"),
        (QWEN, {"size": {"longest_edge": -1}}, r"size.longest_edge=-1 is invalid"),
        (GEMMA3, {"do_pan_and_scan": True}, r"does not apply pan-and-scan \(allowed false\)"),
    ],
)
def test_bad_key_or_value_is_a_clear_error(hf_config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_mm_processor_kwargs(hf_config, kwargs)


def test_min_above_max_is_refused():
    with pytest.raises(ValueError, match="min_pixels=5000 above max_pixels=4096"):
        apply_mm_processor_kwargs(QWEN, {}, {"min_pixels": 5000, "max_pixels": 4096})


def test_gemma3_pan_and_scan_off_is_taken():
    off = {"do_pan_and_scan": False}
    config = apply_mm_processor_kwargs(GEMMA3, {"do_pan_and_scan": True}, off)
    assert config["do_pan_and_scan"] is False


def test_engine_caps_the_real_default_max_pixels(caplog):
    config = {"min_pixels": MIN_PIXELS, "max_pixels": REAL_MAX_PIXELS, "patch_size": PATCH_SIZE}
    xlm_logger = logging.getLogger("xlm")  # it does not propagate to caplog's root handler
    xlm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="xlm"):
            capped = fit_max_pixels(QWEN, config, {}, max_model_len=256, max_num_batched_tokens=64)
    finally:
        xlm_logger.removeHandler(caplog.handler)
    assert capped["max_pixels"] == capped["size"]["longest_edge"] == 64 * FACTOR**2
    assert capped["min_pixels"] == MIN_PIXELS
    (line,) = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    shown_numbers = (f"max_pixels={REAL_MAX_PIXELS}", "200704 tokens", "max_pixels=4096")
    for shown in (*shown_numbers, "max_num_batched_tokens=64", "--mm-processor-kwargs"):
        assert shown in line, shown
    # max_model_len binds when it is the smaller (chunked prefill off).
    capped = fit_max_pixels(QWEN, config, {}, max_model_len=100, max_num_batched_tokens=256)
    assert capped["max_pixels"] == 100 * FACTOR**2
    # A config within the budget is kept as it is.
    small = {"max_pixels": 36 * FACTOR**2, "patch_size": PATCH_SIZE}
    assert fit_max_pixels(QWEN, small, {}, 256, 64) == small


def test_a_users_max_pixels_is_kept_unless_beyond_max_model_len():
    config = {"max_pixels": 200 * FACTOR**2, "patch_size": PATCH_SIZE}
    kwargs = {"max_pixels": 200 * FACTOR**2}
    # Past max_num_batched_tokens but within max_model_len: taken as given.
    assert fit_max_pixels(QWEN, config, kwargs, 256, 64) == config
    with pytest.raises(ValueError, match=r"max_pixels=12800 .* 200 tokens, more than max_mo"):
        fit_max_pixels(QWEN, config, kwargs, 128, 64)


def test_a_min_pixels_the_budget_cannot_hold_is_refused():
    config = {"min_pixels": 80 * FACTOR**2, "max_pixels": REAL_MAX_PIXELS, "patch_size": 4}
    with pytest.raises(ValueError, match="raise max_num_batched_tokens"):
        fit_max_pixels(QWEN, config, {}, 256, 64)


def _config(model_dir, kwargs=None, batched=64):
    model = ModelConfig(model=model_dir, mm_processor_kwargs=kwargs)
    model.hf_config = QWEN
    sched = SchedulerConfig(max_num_batched_tokens=batched, max_model_len=256)
    return XlmConfig(model_config=model, scheduler_config=sched)


def test_every_derived_size_follows_the_resolved_config(real_style_dir):
    # The real default: capped to the step budget's 64 tokens, and the slots follow.
    config = _config(real_style_dir)
    resolved = resolve_processor_config(config)
    assert tokens_per_image(QWEN, resolved) == 64
    assert encoder_cache_slots(QWEN, 64, resolved) == 4
    assert resolve_processor_config(config) is resolved  # computed once, kept
    # An override: 16 tokens an image, so 4 + 2 slots for a 64-token step.
    config = _config(real_style_dir, {"max_pixels": 16 * FACTOR**2})
    resolved = resolve_processor_config(config)
    assert config.model_config.mm_processor_config is resolved
    assert tokens_per_image(QWEN, resolved) == 16
    assert encoder_cache_slots(QWEN, 64, resolved) == 6


def test_model_config_takes_only_an_object():
    with pytest.raises(ValueError, match="ModelConfig.mm_processor_kwargs="):
        ModelConfig(model="m", mm_processor_kwargs="max_pixels=4")
