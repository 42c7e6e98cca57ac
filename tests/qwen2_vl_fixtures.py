"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (vision transformer + merger + the
suite's tiny decoder with M-RoPE), a word-level tokenizer with Qwen's vision tokens, and
the transformers reference (its own PIL image processor, get_rope_index)."""

from __future__ import annotations

import numpy as np

from tests.conftest import _BASE, VOCAB_SIZE, save_checkpoint, word_level_tokenizer

PATCH_SIZE = 4
MERGE_SIZE = 2
MIN_PIXELS = 8 * 8 * 4  # 4 tokens
MAX_PIXELS = 8 * 8 * 36  # 36 tokens, 144 patches
# The real checkpoints' default (Qwen2-VL, Qwen2.5-VL preprocessor_config.json): up to
# 16384 tokens an image at patch 14, 200704 at this suite's patch 4.
REAL_MAX_PIXELS = 12845056
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
IMAGE_PART = "<|vision_start|> <|image_pad|> <|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}" + IMAGE_PART + " "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_qwen_vl_tokenizer():
    """Word-level tokenizer: specials, words w0, w1, ..., then the three vision tokens."""
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(specials) - len(VISION_TOKENS))]
    return word_level_tokenizer(
        specials + words + VISION_TOKENS,
        ["<|im_start|>", "<|im_end|>", *VISION_TOKENS],
        CHAT_TEMPLATE,
    )


def _configs(v25: bool):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
    )

    text = dict(
        _BASE,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    common = dict(
        depth=2,
        num_heads=4,
        in_channels=3,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
    )
    if v25:
        vision = dict(
            common,
            hidden_size=32,
            out_hidden_size=_BASE["hidden_size"],
            intermediate_size=48,
            window_size=16,  # 2x2 merged tokens a window
            fullatt_block_indexes=[1],
            hidden_act="silu",
        )
        cls = Qwen2_5_VLConfig
    else:
        vision = dict(
            common,
            embed_dim=32,
            hidden_size=_BASE["hidden_size"],
            mlp_ratio=2,
            hidden_act="quick_gelu",
        )
        cls = Qwen2VLConfig
    ids = {tok: VOCAB_SIZE - len(VISION_TOKENS) + i for i, tok in enumerate(VISION_TOKENS)}
    return cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|image_pad|>"] - 100,  # no videos here
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def write_tiny_qwen_vl(path: str, v25: bool, seed: int = 0) -> str:
    """Save a random float32 Qwen2-VL (or Qwen2.5-VL), its tokenizer and its
    preprocessor_config.json into `path`."""
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    config = _configs(v25)
    cls = Qwen2_5_VLForConditionalGeneration if v25 else Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # unit-scale weights: clear logit gaps, images that matter
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.shape[-1]
                p.copy_(torch.randn_like(p) * fan_in**-0.5)
    processor = image_processor(MIN_PIXELS, MAX_PIXELS)
    return save_checkpoint(path, model, build_qwen_vl_tokenizer(), processor)


def write_real_style_processor_config(path: str, max_pixels: int = REAL_MAX_PIXELS) -> str:
    """Overwrite `path`'s preprocessor_config.json in the real checkpoints' form (the
    min_pixels / max_pixels keys, no `size`) at the tiny patch size."""
    import json
    import os

    config = {
        "min_pixels": MIN_PIXELS,
        "max_pixels": max_pixels,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": 2,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(config, f)
    return path


def image_processor(min_pixels: int, max_pixels: int, **kwargs):
    """transformers' PIL Qwen2-VL image processor at the tiny patch size."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        **kwargs,
    )


def transformers_greedy(
    path: str,
    token_ids: list[int],
    images: list,
    max_new_tokens: int,
    processor_kwargs: dict | None = None,
):
    """The reference: transformers' model generating greedily on its own processor's
    pixels (loaded with `processor_kwargs`), the prompt's image placeholder expanded to
    h * w / 4 tokens."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    model = _hf_models.get(path)
    if model is None:
        model = _hf_models[path] = AutoModelForImageTextToText.from_pretrained(path).eval()
    image_token = model.config.image_token_id
    kwargs = {}
    ids = list(token_ids)
    if images:
        reference = Qwen2VLImageProcessorPil.from_pretrained(path, **(processor_kwargs or {}))
        processed = reference(images, return_tensors="np")
        grids = np.asarray(processed["image_grid_thw"])
        kwargs["pixel_values"] = torch.tensor(np.asarray(processed["pixel_values"]))
        kwargs["image_grid_thw"] = torch.tensor(grids)
        grid_iter = iter(grids)
        ids = []
        for t in token_ids:
            n = int(np.prod(next(grid_iter))) // MERGE_SIZE**2 if t == image_token else 1
            ids.extend([t] * n)
        kwargs["mm_token_type_ids"] = torch.tensor([[int(t == image_token) for t in ids]])
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


_hf_models: dict = {}
