"""Each family's multimodal processor: images -> pixel arrays, and the prompt's image
placeholder expanded to the tokens the encoder's embeddings replace.

Preprocessing follows the checkpoint's own preprocessor_config.json with numpy and
Pillow (no torch): resize the shortest edge, center crop, rescale, normalize. A family
plugs in with a MultiModalProcessor subclass (how many tokens an image becomes, where its
placeholders go) registered by the config's model_type in PROCESSORS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import numpy as np

from xlm.engine.exceptions import RequestValidationError
from xlm.logger import init_logger
from xlm.multimodal.image import MediaPolicy, check_image
from xlm.multimodal.inputs import MultiModalFeature
from xlm.multimodal.processor_config import read_preprocessor_config
from xlm.multimodal.qwen2_vl import Qwen2VLImagePreprocessor

logger = init_logger(__name__)

_RESAMPLE_DEFAULT = 3  # PIL bicubic, CLIP's


def _edge(size: Any, *keys: str) -> int | None:
    if isinstance(size, int):
        return size
    for key in keys:
        if isinstance(size, dict) and size.get(key):
            return int(size[key])
    return None


class CLIPImagePreprocessor:
    """CLIP-style preprocessing from a preprocessor_config.json dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.do_resize = config.get("do_resize", True)
        size = config.get("size", {"shortest_edge": 224})
        self.shortest_edge = _edge(size, "shortest_edge")
        self.resize_hw = None
        if self.shortest_edge is None:
            self.resize_hw = (int(size["height"]), int(size["width"]))
        self.resample = int(config.get("resample", _RESAMPLE_DEFAULT))
        self.do_center_crop = config.get("do_center_crop", True)
        crop = config.get("crop_size", {"height": 224, "width": 224})
        crop_edge = _edge(crop, "height")
        self.crop_hw = (crop_edge, _edge(crop, "width") or crop_edge)
        self.do_rescale = config.get("do_rescale", True)
        self.rescale_factor = float(config.get("rescale_factor", 1 / 255))
        self.do_normalize = config.get("do_normalize", True)
        self.mean = np.asarray(config.get("image_mean", [0.5, 0.5, 0.5]), np.float32)
        self.std = np.asarray(config.get("image_std", [0.5, 0.5, 0.5]), np.float32)

    def __call__(self, image: Any) -> np.ndarray:
        """An RGB PIL image -> float32 pixels [3, H, W]."""
        if self.do_resize:
            width, height = image.size
            if self.shortest_edge is not None:
                short, long = min(width, height), max(width, height)
                new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
                new_h, new_w = (new_short, new_long) if height <= width else (new_long, new_short)
            else:
                new_h, new_w = self.resize_hw
            image = image.resize((new_w, new_h), resample=self.resample)
        pixels = np.asarray(image, dtype=np.float32)  # [H, W, 3]
        if self.do_center_crop:
            crop_h, crop_w = self.crop_hw
            height, width = pixels.shape[:2]
            if height < crop_h or width < crop_w:  # zeros around it, the odd one before
                pad_h, pad_w = max(crop_h - height, 0), max(crop_w - width, 0)
                pixels = np.pad(
                    pixels,
                    ((pad_h - pad_h // 2, pad_h // 2), (pad_w - pad_w // 2, pad_w // 2), (0, 0)),
                )
                height, width = pixels.shape[:2]
            top, left = (height - crop_h) // 2, (width - crop_w) // 2
            pixels = pixels[top : top + crop_h, left : left + crop_w]
        if self.do_rescale:
            pixels = pixels * np.float32(self.rescale_factor)
        if self.do_normalize:
            pixels = (pixels - self.mean) / self.std
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


def content_hash(modality: str, pixels: np.ndarray) -> str:
    """The encoder cache's key: sha256 over the modality, shape, dtype and pixel bytes."""
    h = hashlib.sha256(f"{modality}:{pixels.shape}:{pixels.dtype}:".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


class MultiModalProcessor:
    """A family's processor: its placeholder token, tokens per image, and the pixels."""

    def __init__(
        self,
        hf_config: Any,
        model_dir: str,
        policy: MediaPolicy,
        processor_config: dict[str, Any] | None = None,
    ) -> None:
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.policy = policy
        # The engine's preprocessor config (xlm.multimodal.processor_config: the
        # checkpoint's with mm_processor_kwargs and the engine's cap), else the checkpoint's.
        if processor_config is None:
            processor_config = read_preprocessor_config(model_dir)
        self.processor_config = processor_config
        self.placeholder_token_id = int(
            getattr(hf_config, "image_token_index", None)
            or getattr(hf_config, "image_token_id", None)
        )
        self._setup(hf_config)

    def _setup(self, hf_config: Any) -> None:
        """The family's own preprocessing and token counts, from `self.processor_config`
        (called last by `__init__`)."""

    def pixels(self, image: Any) -> np.ndarray:
        """An RGB PIL image -> the encoder's input pixels."""
        raise NotImplementedError

    def pixels_and_grid(self, image: Any) -> tuple[np.ndarray, tuple[int, ...] | None]:
        """The encoder's input pixels and, for images of varying size, their patch grid."""
        return self.pixels(image), None

    def num_image_tokens(self, pixels: np.ndarray) -> int:
        """How many placeholder tokens (and encoder embeddings) an image becomes."""
        raise NotImplementedError

    def process(
        self, token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand each image placeholder of the prompt into its image's tokens; one
        feature per image, in prompt order. The prompt must hold one placeholder per image."""
        marks = [i for i, t in enumerate(token_ids) if t == self.placeholder_token_id]
        if len(marks) != len(images):
            raise RequestValidationError(
                f"The prompt has {len(marks)} image placeholders (token id "
                f"{self.placeholder_token_id}) for {len(images)} images: give one placeholder "
                "per image",
                "multi_modal_data",
            )
        out: list[int] = []
        features = []
        prev = 0
        for i, (mark, image) in enumerate(zip(marks, images, strict=True)):
            pixels, grid = self.pixels_and_grid(check_image(image, self.policy, f"image[{i}]"))
            n = self.num_image_tokens(pixels)
            out.extend(token_ids[prev:mark])
            key = content_hash("image" if grid is None else f"image:{grid}", pixels)
            features.append(MultiModalFeature("image", key, len(out), n, pixels, grid))
            out.extend([self.placeholder_token_id] * n)
            prev = mark + 1
        out.extend(token_ids[prev:])
        return out, features


class FixedSizeProcessor(MultiModalProcessor):
    """Images resized to the vision tower's one size (`image_size`), each the same number
    of tokens (`tokens`): LLaVA, Gemma 3."""

    image_size: int
    tokens: int

    def pixels(self, image: Any) -> np.ndarray:
        pixels = self.preprocess(image)
        if pixels.shape[1:] != (self.image_size, self.image_size):
            raise ValueError(
                f"preprocessor_config.json makes {pixels.shape[1:]} images, but the vision "
                f"tower takes {self.image_size}x{self.image_size}"
            )
        return pixels

    def num_image_tokens(self, pixels: np.ndarray) -> int:
        return self.tokens


class LlavaProcessor(FixedSizeProcessor):
    """LLaVA-1.5: CLIP preprocessing; (image_size / patch_size)^2 tokens an image (plus
    the class token with vision_feature_select_strategy 'full')."""

    def _setup(self, hf_config: Any) -> None:
        self.preprocess = CLIPImagePreprocessor(self.processor_config)
        vision = hf_config.vision_config
        self.image_size, self.patch_size = vision.image_size, vision.patch_size
        full = getattr(hf_config, "vision_feature_select_strategy", "default") == "full"
        self.tokens = (self.image_size // self.patch_size) ** 2 + int(full)


def newline_token_ids(model_dir: str) -> dict[int, int]:
    """Newline-run tokens of the checkpoint's tokenizer.json: run length -> token id."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    vocab = data.get("model", {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    pieces = dict(vocab)
    pieces.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return {len(piece): int(i) for piece, i in pieces.items() if piece and set(piece) == {"\n"}}


class Gemma3Processor(FixedSizeProcessor):
    """Gemma 3: the image resized to the tower's size (no crop, no pan-and-scan), and
    each `<start_of_image>` placeholder expanded as transformers' Gemma3Processor does:
    "\n\n", `<start_of_image>`, mm_tokens_per_image image tokens, `<end_of_image>`,
    "\n\n" (a newline run next to it merged into one token, as the tokenizer would)."""

    def _setup(self, hf_config: Any) -> None:
        config = self.processor_config
        if config.get("do_pan_and_scan"):
            logger.warning(
                "preprocessor_config.json asks for pan-and-scan, which xlm does not apply: "
                "each image is resized whole to the vision tower's size (--mm-processor-kwargs "
                "'{\"do_pan_and_scan\": false}' says so and drops this warning)"
            )
        size = hf_config.vision_config.image_size
        self.preprocess = CLIPImagePreprocessor(
            {"resample": 2, "size": {"height": size, "width": size}}  # bilinear
            | config
            | {"do_center_crop": False}
        )
        self.image_size = size
        self.image_token_id = self.placeholder_token_id
        self.placeholder_token_id = int(hf_config.boi_token_index)
        self.eoi_token_id = int(hf_config.eoi_token_index)
        self.tokens = int(hf_config.mm_tokens_per_image)
        self.newlines = newline_token_ids(self.model_dir)
        self.run_of = {i: n for n, i in self.newlines.items()}

    def process(
        self, token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Each placeholder -> [<start_of_image>, image tokens, <end_of_image>] between
        double newlines; the features cover the image tokens only."""
        ids, features = super().process(token_ids, images)
        out: list[int] = []
        out_features = []
        prev = 0
        for f in features:
            boi = f.offset  # super() wrote the image tokens where the placeholder was
            out.extend(ids[prev:boi])
            self._newlines_after(out)
            out.append(self.placeholder_token_id)
            offset = len(out)
            out.extend([self.image_token_id] * f.length)
            out.append(self.eoi_token_id)
            out_features.append(dataclasses.replace(f, offset=offset))
            prev = f.end
            rest = ids[prev:]
            run = self.run_of.get(rest[0]) if rest else None
            if run is not None and run + 2 in self.newlines:
                out.append(self.newlines[run + 2])
                prev += 1
            elif 2 in self.newlines:
                out.append(self.newlines[2])
        out.extend(ids[prev:])
        return out, out_features

    def _newlines_after(self, out: list[int]) -> None:
        """Append "\n\n" to `out`, merged into a newline run that ends it."""
        run = self.run_of.get(out[-1]) if out else None
        if run is not None and run + 2 in self.newlines:
            out[-1] = self.newlines[run + 2]
        elif 2 in self.newlines:
            out.append(self.newlines[2])


class Qwen2VLProcessor(MultiModalProcessor):
    """Qwen2-VL / Qwen2.5-VL: smart_resize preprocessing (xlm.multimodal.qwen2_vl); an
    image of h x w patches becomes h * w / merge_size^2 tokens."""

    def _setup(self, hf_config: Any) -> None:
        self.preprocess = Qwen2VLImagePreprocessor(self.processor_config)
        vision = hf_config.vision_config
        if (self.preprocess.patch_size, self.preprocess.merge_size) != (
            vision.patch_size,
            vision.spatial_merge_size,
        ):
            raise ValueError(
                "preprocessor_config.json's patch_size/merge_size "
                f"{self.preprocess.patch_size}/{self.preprocess.merge_size} differ from the "
                f"vision config's {vision.patch_size}/{vision.spatial_merge_size}"
            )
        self.unit = vision.spatial_merge_size**2
        self.max_tokens = self.preprocess.max_tokens()

    def pixels_and_grid(self, image: Any) -> tuple[np.ndarray, tuple[int, ...] | None]:
        patches, grid = self.preprocess(image)
        if len(patches) // self.unit > self.max_tokens:  # only at extreme aspect ratios
            raise RequestValidationError(
                f"image of {image.width}x{image.height} becomes {len(patches) // self.unit} "
                f"tokens: allowed at most {self.max_tokens} (max_pixels)",
                "image",
            )
        return patches, grid

    def num_image_tokens(self, pixels: np.ndarray) -> int:
        return len(pixels) // self.unit


# model_type -> processor class: a family's entry makes its checkpoints accept images.
PROCESSORS: dict[str, type[MultiModalProcessor]] = {
    "llava": LlavaProcessor,
    "gemma3": Gemma3Processor,
    "qwen2_vl": Qwen2VLProcessor,
    "qwen2_5_vl": Qwen2VLProcessor,
}


def get_mm_processor(
    hf_config: Any,
    model_dir: str,
    policy: MediaPolicy | None = None,
    processor_config: dict[str, Any] | None = None,
) -> MultiModalProcessor | None:
    """The processor of a multimodal checkpoint; None for a text-only one. Its pixels
    follow `processor_config` (the engine's), else the checkpoint's own config."""
    cls = PROCESSORS.get(getattr(hf_config, "model_type", None))
    if cls is None:
        return None
    return cls(hf_config, model_dir, policy or MediaPolicy(), processor_config)
