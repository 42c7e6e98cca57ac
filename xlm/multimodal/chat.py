"""Images in chat messages (OpenAI content parts) for LLM.chat and the chat endpoint.

`image_url` parts (a data URL; a file:// URL under --allowed-local-media-path; an http(s)
URL of a host in --allowed-media-domains) and, from Python, `image_pil` parts (a PIL
image) are loaded and replaced by `{"type": "image"}`, the part chat templates turn into
the model's image placeholder; the images go to the prompt's multi_modal_data in order.
"""

from __future__ import annotations

from typing import Any

from xlm.engine.exceptions import RequestValidationError
from xlm.multimodal.image import MediaPolicy, check_image, load_image_url

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def _part_url(part: dict[str, Any], where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise RequestValidationError(f"{where}.image_url.url must be a string", "messages")
    return url


def extract_images(
    messages: list[Any], policy: MediaPolicy | None, accepts_images: bool
) -> tuple[list[Any], list[Any]]:
    """The messages with each image part as {"type": "image"}, and the images in order
    (a 400 naming the part for a refused or undecodable image, or for images sent to a
    text-only model)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if not accepts_images:
                raise RequestValidationError(
                    f"{where} is an image, but this model takes text only", "messages"
                )
            policy = policy or MediaPolicy()
            if kind == "image_pil":
                images.append(check_image(part.get("image_pil"), policy, where))
            elif kind == "image_url":
                images.append(load_image_url(_part_url(part, where), policy, where))
            else:
                raise RequestValidationError(
                    f"{where} of type 'image' needs its image as an image_url part", "messages"
                )
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def with_images(prompt: dict[str, Any], images: list[Any]) -> dict[str, Any]:
    """A prompt dict with its images as multi_modal_data (unchanged without images)."""
    return {**prompt, "multi_modal_data": {"image": images}} if images else prompt
