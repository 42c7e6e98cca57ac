"""The CLIP vision tower and LLaVA's projector equal transformers' image features."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.multimodal_fixtures import TOKENS_PER_IMAGE, make_image
from xlm.models.clip import quick_gelu, vision_act
from xlm.models.llava import LlavaForConditionalGeneration, vision_layers_run
from xlm.models.loader import build_abstract_model, load_hf_config, load_weights
from xlm.models.loader.safetensors_format import iter_safetensors_tensors


def test_encode_images_equals_transformers(tiny_llava):
    from transformers import CLIPImageProcessorPil
    from transformers import LlavaForConditionalGeneration as HFLlava

    config = load_hf_config(tiny_llava)
    model = build_abstract_model(LlavaForConditionalGeneration, config, jnp.float32)
    model = load_weights(model, iter_safetensors_tensors(tiny_llava), dtype=jnp.float32)
    processor = CLIPImageProcessorPil.from_pretrained(tiny_llava)
    images = [make_image(0), make_image(1, 60, 20)]
    pixels = processor(images, return_tensors="np")["pixel_values"]
    hf = HFLlava.from_pretrained(tiny_llava).eval()
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=torch.tensor(np.asarray(pixels)))
    want = getattr(want, "pooler_output", want)
    want = torch.stack(list(want)) if isinstance(want, list | tuple) else want
    got = np.asarray(model.encode_images(jnp.asarray(pixels)))
    assert got.shape == (2, TOKENS_PER_IMAGE, config.text_config.hidden_size)
    np.testing.assert_allclose(got, want.numpy().reshape(got.shape), atol=1e-4)


def test_feature_layer_indexes_hidden_states():
    class Vision:
        num_hidden_layers = 24

    assert vision_layers_run(Vision, -2) == 23  # LLaVA-1.5: the penultimate layer
    assert vision_layers_run(Vision, -1) == 24
    assert vision_layers_run(Vision, 0) == 0  # the embeddings
    with pytest.raises(ValueError, match="out of range"):
        vision_layers_run(Vision, -26)
    with pytest.raises(ValueError, match="one integer"):
        vision_layers_run(Vision, [-2, -5])


def test_quick_gelu_and_activation_names():
    x = jnp.linspace(-3, 3, 7)
    np.testing.assert_allclose(quick_gelu(x), x * (1 / (1 + np.exp(-1.702 * x))), rtol=1e-6)
    assert vision_act("quick_gelu") is quick_gelu
    with pytest.raises(ValueError, match="not supported"):
        vision_act("swish")
