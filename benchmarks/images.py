"""Images in: images/s and TTFT of LLaVA-1.5 models with one and eight images per request,
and the encoder cache's effect (the same image in every request against distinct images).

Two models, both with random weights (`load_format="dummy"`: only config.json, a
word-level tokenizer and the CLIP preprocessor config are written to a temp dir):
- `tiny`: the test suite's tiny LLaVA shapes: a CLIP tower of 2 layers, 32 wide, 28 px
  images in 7 px patches (16 tokens an image), a 2-layer Llama 64 wide, 256 words.
- `real`: LLaVA-1.5's layout at a size this machine runs: CLIP ViT-B/16 at 224 px (12
  layers, 768 wide, 12 heads, MLP 3072; layers up to vision_feature_layer=-2 run: 11),
  196 tokens an image, the two-layer GELU projector 768 -> 576, and SmolLM2-135M's
  decoder (30 layers, 576 wide, 9 heads, 3 KV heads, MLP 1536, 49152 words).

For each model and each images-per-request count K:
- TTFT: one request of K images never seen before and a short text, max_tokens=1, timed
  alone (`--repeats` times, median); its time includes preprocessing, encoding, prefill.
- images/s: `--requests` requests of K images each, submitted together, max_tokens=1:
  images / wall time, with every image distinct (each encoded once: encoder cache misses),
  and with one image repeated in every slot of every request (encoded once, then cache
  hits). Each request starts with its own word so no prompt shares a prefix block with
  another: the repeated-image rows measure the encoder cache, not the prefix cache.
Every program is compiled before timing; the compile counter must not move during the runs
(checked, in the JSON).

    python benchmarks/images.py [--models tiny,real] [--images 1,8] [--requests 8]
        [--repeats 3] [--out benchmarks/images.json]

Prints a table and writes the JSON (`--out`). The figures are machine-specific: run on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

IMAGE_TOKEN = "<image>"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]

# model name -> (vision config, text config, max_num_batched_tokens)
MODELS = {
    "tiny": (
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=28,
            patch_size=7,
            projection_dim=32,
        ),
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        ),
        128,
    ),
    "real": (
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=16,
            projection_dim=512,
            hidden_act="quick_gelu",
        ),
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
        512,
    ),
}


def write_model(root: str, name: str) -> tuple[str, int]:
    """config.json, tokenizer and preprocessor config of `name` in root/name: (path,
    tokens per image)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        PreTrainedTokenizerFast,
    )

    vision_kw, text_kw, _ = MODELS[name]
    path = os.path.join(root, name)
    vocab_size = text_kw["vocab_size"]
    text = LlamaConfig(**text_kw, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**vision_kw),
        text_config=text,
        image_token_index=vocab_size - 1,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(path)
    words = [f"w{i}" for i in range(vocab_size - len(SPECIALS) - 1)]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + words + [IMAGE_TOKEN])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=[IMAGE_TOKEN],
    ).save_pretrained(path)
    size = vision_kw["image_size"]
    CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(path)
    return path, (size // vision_kw["patch_size"]) ** 2


def make_images(rng: np.random.Generator, count: int, size: int) -> list:
    """`count` distinct random RGB images of size x size pixels."""
    from PIL import Image

    return [
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)
    ]


class Bench:
    """One model's engine and its prompts."""

    def __init__(self, name: str, root: str, args: argparse.Namespace) -> None:
        import xlm

        self.xlm = xlm
        self.path, self.tokens_per_image = write_model(root, name)
        most = max(args.images)
        batched = MODELS[name][2]
        start = time.perf_counter()
        self.llm = xlm.LLM(
            model=self.path,
            load_format="dummy",
            max_model_len=most * self.tokens_per_image + 64,
            max_num_seqs=args.requests,
            max_num_batched_tokens=batched,
            limit_mm_per_prompt={"image": most},
            startup_programs="all",  # steady state: every program before anything is timed
        )
        self.load_s = time.perf_counter() - start
        self.image_size = MODELS[name][0]["image_size"] * 2  # resized by the preprocessor
        self.rng = np.random.default_rng(0)
        self.request_no = 0

    def prompt(self, images: list) -> dict:
        """A prompt of its own first word (no shared prefix block), K placeholders, text."""
        self.request_no += 1
        word = f"w{self.request_no % 200 + 10}"
        text = " ".join([word, *[IMAGE_TOKEN] * len(images), "w3 w4 w5"])
        return {"prompt": text, "multi_modal_data": {"image": images}}

    def run(self, prompts: list[dict]) -> float:
        params = self.xlm.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    def new_images(self, count: int) -> list:
        return make_images(self.rng, count, self.image_size)

    def measure(self, k: int, requests: int, repeats: int) -> dict:
        """TTFT of one request of k new images; images/s of `requests` such requests with
        distinct and with repeated images."""
        self.run([self.prompt(self.new_images(k))])  # warm the path once
        ttft = [self.run([self.prompt(self.new_images(k))]) for _ in range(repeats)]
        out = {"ttft_s": statistics.median(ttft), "ttft_runs_s": ttft}
        for mode in ("distinct", "repeated"):
            stats0 = self.llm.llm_engine.encoder_cache_stats()
            times = []
            for _ in range(repeats):
                if mode == "distinct":
                    batch = [self.prompt(self.new_images(k)) for _ in range(requests)]
                else:
                    same = self.new_images(1)[0]
                    batch = [self.prompt([same] * k) for _ in range(requests)]
                times.append(self.run(batch))
            stats = self.llm.llm_engine.encoder_cache_stats()
            out[mode] = {
                "images_per_s": requests * k / statistics.median(times),
                "wall_runs_s": times,
                "encoded": stats["misses"] - stats0["misses"],
                "cache_hits": stats["hits"] - stats0["hits"],
            }
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,real", help="comma-separated: tiny, real")
    parser.add_argument("--images", default="1,8", help="images per request, comma-separated")
    parser.add_argument("--requests", type=int, default=8, help="requests in the images/s batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "images.json"))
    args = parser.parse_args()
    args.images = [int(k) for k in args.images.split(",")]
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models {unknown} unknown: allowed {list(MODELS)}")
    import jax

    import xlm.platforms

    # xlm's platform first: on a host without an accelerator it pins JAX to its CPU
    # backend, so jax.devices() starts no installed plugin's (libtpu logs errors there).
    xlm.platforms.current_platform  # noqa: B018
    results: dict = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "device": str(jax.devices()[0].device_kind),
        },
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            bench = Bench(name, root, args)
            compiled = bench.llm.llm_engine.num_compilations
            runs = {k: bench.measure(k, args.requests, args.repeats) for k in args.images}
            results["models"][name] = {
                "tokens_per_image": bench.tokens_per_image,
                "vision": MODELS[name][0],
                "text": MODELS[name][1],
                "max_num_batched_tokens": MODELS[name][2],
                "load_s": bench.load_s,
                "compiles_after_warmup": bench.llm.llm_engine.num_compilations - compiled,
                "runs": {str(k): v for k, v in runs.items()},
            }
            del bench
    print_table(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    return 0


def print_table(results: dict) -> None:
    header = (
        f"{'model':<6}{'img/req':>8}{'TTFT s':>9}{'img/s distinct':>16}{'img/s repeated':>16}"
        f"{'repeat/distinct':>17}{'encoded d/r':>13}"
    )
    print(header)
    print("-" * len(header))
    for name, m in results["models"].items():
        for k, r in m["runs"].items():
            d, rep = r["distinct"], r["repeated"]
            print(
                f"{name:<6}{k:>8}{r['ttft_s']:>9.3f}{d['images_per_s']:>16.1f}"
                f"{rep['images_per_s']:>16.1f}{rep['images_per_s'] / d['images_per_s']:>16.2f}x"
                f"{d['encoded']:>7}/{rep['encoded']:<5}"
            )
        print(f"  ({name}: compiles after warm-up: {m['compiles_after_warmup']})")


if __name__ == "__main__":
    sys.exit(main())
