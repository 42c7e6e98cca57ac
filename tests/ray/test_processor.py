"""Ray batch jobs with images: chat rows whose content holds image_url parts (data URLs)
run through xlm replicas on a local Ray cluster, and each row's greedy reply equals
LLM.chat's on the same conversation; a bad image is that row's error, not the job's."""

from __future__ import annotations

import base64
import io

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import xlm  # noqa: E402
from tests.engine.reference import TINY_ENGINE  # noqa: E402
from tests.multimodal_fixtures import make_image  # noqa: E402
from xlm.ray import ProcessorConfig, build_llm_processor  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 4


def _data_url(seed: int) -> str:
    buf = io.BytesIO()
    make_image(seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(urls: list[str], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_rows_with_images_equal_llm_chat(tiny_llava, tiny_llava_llm, ray_cluster):
    # The reference engine first: its programs are compiled (into the program cache the
    # replica loads them from) before the cluster's daemons start.
    one, two = _data_url(40), _data_url(41)
    conversations = [_messages([one], "w5 w9"), _messages([one, two], "w3"), _messages([two], "w7")]
    rows = [{"id": i, "messages": m} for i, m in enumerate(conversations)]
    rows.append({"id": 3, "messages": _messages(["data:image/png;base64,@@@"], "w1")})
    config = ProcessorConfig(
        model=tiny_llava, engine_kwargs=TINY_ENGINE, replicas=1, batch_size=4, num_cpus=0.5
    )
    params = {"max_tokens": MAX_TOKENS, "temperature": 0}
    out = build_llm_processor(config, sampling_params=params)(ray.data.from_items(rows))
    got = {r["id"]: r for r in out.take_all()}

    sampling = xlm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    expected = tiny_llava_llm.chat(conversations, sampling, use_tqdm=False)
    for i, reference in enumerate(expected):
        assert got[i]["error"] is None, got[i]["error"]
        assert got[i]["generated_token_ids"] == list(reference.outputs[0].token_ids)
        assert got[i]["num_input_tokens"] == len(reference.prompt_token_ids)
    assert got[3]["generated_text"] is None and "messages[0].content[0]" in got[3]["error"]
