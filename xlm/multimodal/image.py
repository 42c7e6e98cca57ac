"""Images from users: decoded, size-checked and fetched under the media policy.

Every refusal is a RequestValidationError (HTTP 400) naming the parameter: an image that
does not decode, is truncated, is larger than the pixel cap, or comes from a place the
policy does not allow (a local file outside --allowed-local-media-path, a remote host not
in --allowed-media-domains: no server-side request to arbitrary hosts by default).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from xlm.engine.exceptions import RequestValidationError

# Default cap on an image's pixels (width x height) before it is decoded: 64 Mpx.
DEFAULT_MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# Default cap on the bytes of one image read from a data URL, a file or a remote host.
DEFAULT_MAX_IMAGE_BYTES = 32 * 1024 * 1024
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = FETCH_TIMEOUT_S


def _refuse(message: str, param: str) -> RequestValidationError:
    return RequestValidationError(message, param)


def check_image(image: Any, policy: MediaPolicy, param: str = "image") -> Any:
    """A PIL image, fully decoded and in RGB, within the pixel cap (else a 400)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise _refuse(
            f"{param} of type {type(image).__name__} is invalid: expected a PIL.Image.Image",
            param,
        )
    width, height = image.size
    if width < 1 or height < 1:
        raise _refuse(f"{param} has size {width}x{height}: it is empty", param)
    if width * height > policy.max_image_pixels:
        raise _refuse(
            f"{param} has {width}x{height} = {width * height} pixels, more than the "
            f"{policy.max_image_pixels} allowed",
            param,
        )
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise _refuse(f"{param} could not be decoded: {e}", param) from None


def decode_image(data: bytes, policy: MediaPolicy, param: str = "image") -> Any:
    """Bytes of an image file -> a checked RGB PIL image (a 400 when they are not one)."""
    from PIL import Image

    if len(data) > policy.max_image_bytes:
        raise _refuse(
            f"{param} is {len(data)} bytes, more than the {policy.max_image_bytes} allowed",
            param,
        )
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise _refuse(f"{param} is not a supported image: {e}", param) from None
    return check_image(image, policy, param)


def load_image_url(url: str, policy: MediaPolicy, param: str = "image_url") -> Any:
    """An image from a data URL, a file:// URL under the allowed local path, or an
    http(s) URL whose host the policy allows."""
    if not isinstance(url, str) or not url:
        raise _refuse(f"{param} must be a non-empty URL string", param)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return decode_image(_data_url_bytes(url, param), policy, param)
    if scheme == "file":
        return decode_image(_local_file_bytes(url, policy, param), policy, param)
    if scheme in ("http", "https"):
        return decode_image(_remote_bytes(url, policy, param), policy, param)
    raise _refuse(
        f"{param} has scheme {scheme!r}: allowed 'data:' URLs, 'file://' under "
        "--allowed-local-media-path, and http(s) hosts named in --allowed-media-domains",
        param,
    )


def _data_url_bytes(url: str, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise _refuse(f"{param} is not a base64 data URL ('data:image/...;base64,...')", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _refuse(f"{param} has invalid base64 data: {e}", param) from None


def _local_file_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    root = policy.allowed_local_media_path
    if not root:
        raise _refuse(
            f"{param}: file:// URLs are refused; start the server with "
            "--allowed-local-media-path DIR to allow files under DIR",
            param,
        )
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(root)
    if os.path.commonpath([root, path]) != root:
        raise _refuse(f"{param}: {path!r} is outside --allowed-local-media-path", param)
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise _refuse(f"{param}: cannot read {path!r}: {e.strerror}", param) from None
    return data


def _remote_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if host not in {d.lower() for d in policy.allowed_media_domains}:
        raise _refuse(
            f"{param}: fetching images from host {host!r} is not allowed; name it in "
            "--allowed-media-domains to allow it",
            param,
        )
    import httpx

    try:
        with httpx.stream(
            "GET", url, timeout=policy.fetch_timeout_s, follow_redirects=False
        ) as response:
            if response.status_code != 200:
                raise _refuse(f"{param}: {url} answered HTTP {response.status_code}", param)
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > policy.max_image_bytes:
                    break
            return bytes(data)
    except httpx.HTTPError as e:
        raise _refuse(f"{param}: fetching {url} failed: {e}", param) from None
