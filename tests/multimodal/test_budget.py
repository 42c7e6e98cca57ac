"""The encoder cache's slots: a full step's images plus two, at least MIN_ENCODER_SLOTS."""

from types import SimpleNamespace

from xlm.multimodal.budget import MIN_ENCODER_SLOTS, encoder_cache_slots, tokens_per_image


def _llava(image_size=336, patch_size=14, strategy="default"):
    vision = SimpleNamespace(image_size=image_size, patch_size=patch_size)
    return SimpleNamespace(
        model_type="llava", vision_config=vision, vision_feature_select_strategy=strategy
    )


def test_tokens_per_image_follows_the_select_strategy():
    assert tokens_per_image(_llava()) == 576  # LLaVA-1.5 at 336 px
    assert tokens_per_image(_llava(strategy="full")) == 577
    assert tokens_per_image(SimpleNamespace(model_type="llama")) is None


def test_slots_cover_a_full_step():
    assert encoder_cache_slots(_llava(), 8192) == 15 + 2
    assert encoder_cache_slots(_llava(28, 7), 64) == 6  # 4 images of 16 tokens, plus 2
    assert encoder_cache_slots(_llava(), 16) == MIN_ENCODER_SLOTS
    assert encoder_cache_slots(SimpleNamespace(model_type="llama"), 64) == 0


def _gemma3(tokens=256):
    vision = SimpleNamespace(image_size=896, patch_size=14)
    return SimpleNamespace(model_type="gemma3", vision_config=vision, mm_tokens_per_image=tokens)


def test_gemma3_images_are_fixed_size_and_whole():
    import pytest

    from xlm.multimodal.budget import bidirectional_images, images_in_one_step

    assert tokens_per_image(_gemma3()) == 256
    assert bidirectional_images(_gemma3()) and not bidirectional_images(_llava())

    def config(hf_config, batched, threshold=0):
        sched = SimpleNamespace(
            max_num_batched_tokens=batched, long_prefill_token_threshold=threshold
        )
        return SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config), scheduler_config=sched
        )

    assert images_in_one_step(config(_gemma3(), 512))
    assert not images_in_one_step(config(_llava(), 64))
    with pytest.raises(ValueError, match="max_num_batched_tokens=128"):
        images_in_one_step(config(_gemma3(), 128))
    with pytest.raises(ValueError, match="long_prefill_token_threshold=100"):
        images_in_one_step(config(_gemma3(), 512, 100))
