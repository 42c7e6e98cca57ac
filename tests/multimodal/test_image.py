"""Images from users: decoding, the pixel and byte caps, and the media policy (data URLs
always; file:// only under the allowed path; remote hosts only when named)."""

from __future__ import annotations

import base64
import io

import pytest

from tests.multimodal_fixtures import make_image
from xlm.engine.exceptions import RequestValidationError
from xlm.multimodal.image import MediaPolicy, check_image, decode_image, load_image_url


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_data_url_decodes_to_rgb():
    image = make_image(0).convert("L")
    out = load_image_url(_data_url(_png(image)), MediaPolicy())
    assert out.mode == "RGB" and out.size == image.size


@pytest.mark.parametrize(
    "url, match",
    [
        ("data:image/png;base64,@@@", "invalid base64"),
        ("data:image/png,rawbytes", "not a base64 data URL"),
        (_data_url(b"not an image at all"), "not a supported image"),
        ("ftp://host/x.png", "scheme 'ftp'"),
        ("file:///etc/passwd", "--allowed-local-media-path"),
        ("http://169.254.169.254/latest/meta-data", "not allowed"),
        ("", "non-empty URL"),
    ],
)
def test_refused_urls_are_400s(url, match):
    with pytest.raises(RequestValidationError, match=match) as err:
        load_image_url(url, MediaPolicy(), "messages[0].content[0]")
    assert err.value.param == "messages[0].content[0]"


def test_truncated_image_is_refused():
    data = _png(make_image(1))
    with pytest.raises(RequestValidationError, match="decoded|supported"):
        decode_image(data[: len(data) // 2], MediaPolicy())


def test_pixel_and_byte_caps():
    data = _png(make_image(2, 40, 30))
    with pytest.raises(RequestValidationError, match="1200 pixels, more than the 1000"):
        decode_image(data, MediaPolicy(max_image_pixels=1000))
    with pytest.raises(RequestValidationError, match="bytes, more than the 10 allowed"):
        decode_image(data, MediaPolicy(max_image_bytes=10))
    assert decode_image(data, MediaPolicy(max_image_pixels=1200)).size == (40, 30)


def test_local_files_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    make_image(3).save(allowed / "a.png")
    make_image(4).save(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image_url((allowed / "a.png").as_uri(), policy).size == (40, 33)
    for outside in (tmp_path / "secret.png", allowed / ".." / "secret.png"):
        with pytest.raises(RequestValidationError, match="outside"):
            load_image_url("file://" + str(outside), policy)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(RequestValidationError, match="outside"):
        load_image_url((allowed / "link.png").as_uri(), policy)


def test_allowed_host_is_fetched_with_the_caps(monkeypatch):
    import httpx

    data = _png(make_image(5))
    seen = []

    class Response:
        status_code = 200

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def iter_bytes(self):
            yield data

    def stream(method, url, timeout, follow_redirects):
        seen.append((url, timeout, follow_redirects))
        return Response()

    monkeypatch.setattr(httpx, "stream", stream)
    policy = MediaPolicy(allowed_media_domains=("images.example",))
    assert load_image_url("https://images.example/cat.png", policy).size == (40, 33)
    assert seen == [("https://images.example/cat.png", policy.fetch_timeout_s, False)]
    with pytest.raises(RequestValidationError, match="not allowed"):
        load_image_url("https://other.example/cat.png", policy)
    assert len(seen) == 1  # nothing fetched from a host not named


def test_check_image_needs_a_pil_image():
    with pytest.raises(RequestValidationError, match="expected a PIL.Image.Image"):
        check_image(b"bytes", MediaPolicy())
