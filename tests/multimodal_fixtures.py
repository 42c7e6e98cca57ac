"""A tiny random LLaVA-1.5 checkpoint (CLIP tower + projector + Llama) with a processor
config and a word-level tokenizer whose `<image>` is a special token, and test images."""

from __future__ import annotations

import numpy as np

from tests.conftest import _BASE, VOCAB_SIZE

IMAGE_SIZE = 28
PATCH_SIZE = 7
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16: the class token is dropped
IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    projection_dim=32,
)


def build_llava_tokenizer():
    """Word-level tokenizer: specials, `<image>` (the last id) and words w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(specials) - 1)]
    vocab = {tok: i for i, tok in enumerate(specials + words + [IMAGE_TOKEN])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", IMAGE_TOKEN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tiny_llava(path: str, seed: int = 0) -> str:
    """Save a random float32 LlavaForConditionalGeneration, its tokenizer and its
    preprocessor_config.json (CLIP preprocessing at IMAGE_SIZE) into `path`."""
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(**TINY_VISION)
    # The text model is the suite's tiny Llama, with room for a prompt of several images.
    text = LlamaConfig(**dict(_BASE, max_position_embeddings=512))
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB_SIZE - 1)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # unit-scale weights: clear logit gaps, images that matter
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("class_embedding"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.shape[-1]
                p.copy_(torch.randn_like(p) * fan_in**-0.5)
    model.save_pretrained(path)
    build_llava_tokenizer().save_pretrained(path)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(path)
    return path


def write_llava_config(path: str, text: dict) -> str:
    """A directory with only the config.json of a LLaVA with the tiny vision tower and the
    text model `text` (xlm plan reads no weights)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(**TINY_VISION)
    text_config = LlamaConfig(**text)
    config = LlavaConfig(
        vision_config=vision, text_config=text_config, image_token_index=text["vocab_size"] - 1
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(path)
    return path


def make_image(seed: int, width: int = 40, height: int = 33):
    """A random RGB PIL image (not square, so resize and crop both act)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def expand_placeholders(token_ids: list[int], image_token_id: int) -> list[int]:
    """transformers' LlavaProcessor expansion: each `<image>` -> TOKENS_PER_IMAGE of them."""
    out: list[int] = []
    for t in token_ids:
        out.extend([t] * TOKENS_PER_IMAGE if t == image_token_id else [t])
    return out


def transformers_greedy(path: str, token_ids: list[int], images: list, max_new_tokens: int):
    """The reference: transformers' LLaVA generating greedily on its own CLIP processor's
    pixels (the PIL backend) from the prompt with its placeholders expanded."""
    import torch
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration

    model = _hf_models.get(path)
    if model is None:
        model = _hf_models[path] = LlavaForConditionalGeneration.from_pretrained(path).eval()
    processor = CLIPImageProcessorPil.from_pretrained(path)
    ids = expand_placeholders(token_ids, model.config.image_token_index)
    kwargs = {}
    if images:
        pixels = processor(images, return_tensors="np")["pixel_values"]
        kwargs["pixel_values"] = torch.tensor(np.asarray(pixels))
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


_hf_models: dict = {}
