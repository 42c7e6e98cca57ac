"""`xlm run-batch` with images: chat-completion lines whose content holds image_url parts
(data URLs; file:// under --allowed-local-media-path) answer as LLM.chat does on the same
images; a bad, refused or excess image is that line's 400 and the job goes on."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import pytest

import xlm
from tests.engine.reference import TINY_ENGINE, cli_engine_flags
from tests.multimodal_fixtures import make_image

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 5


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(urls: list[str], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _record(custom_id: str, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_chat_lines_with_images_equal_llm_chat(tiny_llava, tiny_llava_llm, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    one, two = make_image(50), make_image(51)
    two.save(allowed / "two.png")
    make_image(52).save(tmp_path / "outside.png")
    good = {
        "one": _messages([_data_url(one)], "w5 w9"),
        "two": _messages([_data_url(one), (allowed / "two.png").as_uri()], "w3"),
    }
    bad = {
        "truncated": _messages(["data:image/png;base64," + _data_url(one)[22:80]], "w1"),
        "outside": _messages([(tmp_path / "outside.png").as_uri()], "w1"),
        "remote": _messages(["http://127.0.0.1:1/a.png"], "w1"),
        "too-many": _messages([_data_url(one)] * 3, "w1"),
    }
    records = [_record(k, m) for k, m in {**good, **bad}.items()]
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = dict(os.environ, XLM_COMPILATION_CACHE_DIR=str(tmp_path / "cc"))
    env["XLM_DISABLE_PROGRESS_BARS"] = "1"
    cmd = [
        *(sys.executable, "-m", "xlm.entrypoints.cli", "run-batch"),
        *("-i", str(infile), "-o", str(outfile), "--model", tiny_llava),
        *cli_engine_flags(TINY_ENGINE),
        *("--allowed-local-media-path", str(allowed)),
        *("--limit-mm-per-prompt", '{"image": 2}', "--disable-log-stats"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the bad lines failed
    results = {r["custom_id"]: r for r in map(json.loads, open(outfile))}

    params = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    same = [_messages([_data_url(one)], "w5 w9"), _messages([_data_url(one), _data_url(two)], "w3")]
    expected = tiny_llava_llm.chat(same, params, use_tqdm=False)
    for name, reference in zip(good, expected):
        result = results[name]
        assert result["error"] is None and result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        assert body["choices"][0]["message"]["content"] == reference.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
    for name in bad:
        response = results[name]["response"]
        assert response["status_code"] == 400, (name, response)
        assert response["body"]["error"]["message"], name  # OpenAI's error shape
