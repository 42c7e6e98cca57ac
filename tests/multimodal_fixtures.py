"""A tiny random LLaVA-1.5 checkpoint (CLIP tower + projector + Llama) with a processor
config and a word-level tokenizer whose `<image>` is a special token, and test images."""

from __future__ import annotations

import numpy as np

from tests.conftest import _BASE, VOCAB_SIZE, save_checkpoint, word_level_tokenizer

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
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(specials) - 1)]
    return word_level_tokenizer(
        specials + words + [IMAGE_TOKEN],
        ["<|im_start|>", "<|im_end|>", IMAGE_TOKEN],
        CHAT_TEMPLATE,
    )


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
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return save_checkpoint(path, model, build_llava_tokenizer(), processor)


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


# ---- Gemma 3 (SigLIP + projector + Gemma 3 text) -----------------------------------------
GEMMA3_TOKENS_PER_IMAGE = 4  # the 4x4 patch grid average-pooled 2x2
GEMMA3_SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<start_of_image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)


def build_gemma3_tokenizer():
    """Word-level tokenizer: specials, words, "\\n\\n" (an added token, as Gemma's single
    double-newline token) and Gemma 3's image tokens (the last three ids)."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    specials += ["user", "model"]  # the chat template's roles
    words = [f"w{i}" for i in range(VOCAB_SIZE - len(specials) - 4)]
    return word_level_tokenizer(
        specials + words + ["\n\n", *GEMMA3_SPECIALS],
        ["<start_of_turn>", "<end_of_turn>", *GEMMA3_SPECIALS],
        GEMMA3_CHAT_TEMPLATE,
        bos="<bos>",
        eos="<eos>",
        added=("\n\n",),
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )


def write_tiny_gemma3(path: str, seed: int = 0) -> str:
    """Save a random float32 Gemma3ForConditionalGeneration (tiny SigLIP, the suite's tiny
    Gemma 3 text model), its tokenizer and its Gemma 3 preprocessor config into `path`."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from tests.conftest import TINY_CONFIGS

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        vision_use_head=False,
    )
    text = Gemma3TextConfig(**dict(_BASE, **TINY_CONFIGS["gemma3"][1], max_position_embeddings=512))
    config = Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=VOCAB_SIZE - 3,
        eoi_token_index=VOCAB_SIZE - 2,
        image_token_index=VOCAB_SIZE - 1,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # unit-scale weights: clear logit gaps, images that matter
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                # Gemma's (1 + w) norms: the layers' outputs 4x the embeddings, so the
                # tied LM head does not just echo the last token.
                base = 1.0 if "layer_norm" in name else 3.0 if "post_" in name else 0.0
                p.copy_(0.1 * torch.randn_like(p) + base)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):  # scaled by sqrt(hidden): unit RMS
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            elif "embedding" in name:
                p.copy_(torch.randn_like(p))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.shape[-1]
                p.copy_(torch.randn_like(p) * fan_in**-0.5)
    processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return save_checkpoint(path, model, build_gemma3_tokenizer(), processor)


def make_blocky_image(seed: int, width: int = 40, height: int = 33):
    """A random RGB PIL image of 4x4 flat color blocks: features that survive Gemma 3's
    average pooling (pixel noise averages out to nearly the same embedding)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    return small.resize((width, height), Image.NEAREST)


def gemma3_reference_inputs(path: str, prompt: str, images: list) -> dict:
    """transformers' Gemma3Processor on the prompt text and images: input_ids,
    token_type_ids (1 on image tokens) and pixel_values, as torch tensors."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    processor = Gemma3Processor(
        Gemma3ImageProcessorPil.from_pretrained(path),
        AutoTokenizer.from_pretrained(path),
        image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
    )
    return dict(processor(text=prompt, images=images or None, return_tensors="pt"))


def gemma3_transformers_greedy(
    path: str, prompt: str, images: list, max_new_tokens: int, bidirectional: bool = True
):
    """The reference: transformers' Gemma 3 generating greedily from its own processor's
    inputs (the bidirectional mask over each image's tokens from token_type_ids; causal
    only without them)."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    model = _hf_models.get(path)
    if model is None:
        model = _hf_models[path] = Gemma3ForConditionalGeneration.from_pretrained(path).eval()
    inputs = gemma3_reference_inputs(path, prompt, images)
    inputs.pop("attention_mask", None)
    if not bidirectional:
        inputs.pop("token_type_ids")
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, n:].tolist(), inputs["input_ids"][0].tolist()


def generate_with_images(llm, prompt: str, images: list, params):
    """One request of `prompt` with `images` (vLLM's multi_modal_data); its output."""
    request = {"prompt": prompt, "multi_modal_data": {"image": images}}
    return llm.generate(request, params, use_tqdm=False)[0]


def generate_sharing_one_image(llm, prompts: list[str], image, params) -> list:
    """Requests that all read one image: it is encoded once (one miss, the other reads
    hits); their outputs."""
    before = llm.llm_engine.encoder_cache_stats()
    requests = [{"prompt": p, "multi_modal_data": {"image": image}} for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    after = llm.llm_engine.encoder_cache_stats()
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] - before["hits"] >= 1
    return outs


_TP_SCRIPT = """
import json, sys
import xlm
from tests import multimodal_fixtures
from tests.engine.reference import TINY_ENGINE
make_image = getattr(multimodal_fixtures, sys.argv[3])
llm = xlm.LLM(model=sys.argv[1], tensor_parallel_size=2, **TINY_ENGINE)
compiled = llm.llm_engine.num_compilations
outs = llm.generate(
    [{"prompt": sys.argv[2], "multi_modal_data": {"image": make_image(*args)}}
     for args in json.loads(sys.argv[4])],
    xlm.SamplingParams(max_tokens=int(sys.argv[5]), temperature=0),
    use_tqdm=False,
)
print(json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "compiled_after_warmup": llm.llm_engine.num_compilations - compiled,
}))
"""


def generate_with_tensor_parallel(
    model: str,
    prompt: str,
    image_maker: str,
    image_args: list[list[int]],
    num_devices: int,
    max_tokens: int = 6,
) -> dict:
    """Greedy tokens of one request per image (`image_maker(*args)` of this module) at
    TP=2, in a fresh process with `num_devices` fake CPU devices (JAX fixes the count at
    start): {"tokens": [...], "compiled_after_warmup": n}."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import fake_devices_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = fake_devices_env(num_devices, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    args = [model, prompt, image_maker, json.dumps(image_args), str(max_tokens)]
    proc = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, *args],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
