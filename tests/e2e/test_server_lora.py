"""LoRA adapters over HTTP: `xlm serve --enable-lora` with the official openai client.

Adapters are selected by a request's model (the names of --lora-modules and of runtime
loads), listed by /v1/models, loaded and unloaded at run time under --lora-root, and every
bad load is a 400 the server survives. The reference is xlm's offline engine with the same
adapter (the engine's own tests compare it with transformers + peft). run-batch selects
adapters the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

import xlm
from tests.e2e.server_utils import REPO_ROOT, RemoteServer
from tests.engine.reference import TINY_ENGINE, cli_engine_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

API_KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = "base"  # the served model name
PROMPT = "w5 w17 w33"
MESSAGES = [{"role": "user", "content": "w9 w41 w2"}]
MAX_TOKENS = 8
LONG_TOKENS = 200  # a request still running when its adapter is unloaded
LORA_ENGINE = dict(TINY_ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)
ENGINE_FLAGS = [
    *cli_engine_flags(TINY_ENGINE),
    "--startup-programs",
    "all",
    "--enable-lora",
    "--max-loras",
    "2",
    "--max-lora-rank",
    "8",
    "--served-model-name",
    BASE,
    "--disable-log-stats",
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: str, path: Path, seed: int, rank: int = 8) -> str:
    """A PEFT adapter of `base` with random nonzero A and B (it changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(path))
    return str(path)


def write_malformed(good: str, root: Path) -> dict[str, Path]:
    """Adapters the engine must refuse, each for one reason, under `root`."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(good) / "adapter_config.json").read_text())
    bad_json = root / "bad-json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text('{"r": 8, "lora_alpha": ')
    (bad_json / "adapter_model.safetensors").write_bytes(
        (Path(good) / "adapter_model.safetensors").read_bytes()
    )
    no_module = root / "no-module"
    no_module.mkdir()
    (no_module / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.mlp.nonexistent"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.randn(8, 64),
            f"{prefix}.lora_B.weight": torch.randn(64, 8),
        },
        str(no_module / "adapter_model.safetensors"),
    )
    return {"bad_json": bad_json, "no_module": no_module}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, str]:
    """Adapters on disk: a1 outside the root (a start-up module), a2 under it, a symlink
    from the root to outside it, and malformed ones under it."""
    base = tiny_checkpoint("llama")
    tmp = tmp_path_factory.mktemp("lora")
    root, outside = tmp / "root", tmp / "outside"
    root.mkdir()
    outside.mkdir()
    paths = {
        "base": base,
        "root": str(root),
        "a1": write_adapter(base, outside / "a1", seed=1),
        "a2": write_adapter(base, root / "a2", seed=2),
        "rank16": write_adapter(base, root / "rank16", seed=3, rank=16),
    }
    (root / "escape").symlink_to(outside / "a1", target_is_directory=True)
    paths.update({k: str(v) for k, v in write_malformed(paths["a1"], root).items()})
    return paths


@pytest.fixture(scope="module")
def reference(adapters) -> dict[tuple[str | None, str], str]:
    """xlm's offline engine: (adapter name or None, "completion" | "chat" | "long") -> text."""
    llm = xlm.LLM(model=adapters["base"], **LORA_ENGINE)
    greedy = xlm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    long = xlm.SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
    out = {}
    for lora_id, name in enumerate([None, "a1", "a2"]):
        lora = None if name is None else xlm.LoRARequest(name, lora_id, adapters[name])
        [completion] = llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=lora)
        [chat] = llm.chat(MESSAGES, greedy, use_tqdm=False, lora_request=lora)
        [longer] = llm.generate([PROMPT], long, use_tqdm=False, lora_request=lora)
        out[name, "completion"] = completion.outputs[0].text
        out[name, "chat"] = chat.outputs[0].text
        out[name, "long"] = longer.outputs[0].text
    del llm
    # Each adapter changes the output, so a test passing with it cannot ignore it.
    assert len({out[name, "completion"] for name in (None, "a1", "a2")}) == 3
    assert len({out[name, "chat"] for name in (None, "a1", "a2")}) == 3
    return out


@pytest.fixture(scope="module")
def server(adapters, reference):
    """A server with a1 from the start (outside --lora-root) and runtime loading on."""
    flags = [
        *ENGINE_FLAGS,
        "--api-key",
        API_KEY,
        "--lora-modules",
        f"a1={adapters['a1']}",
        "--lora-root",
        adapters["root"],
        "--allow-runtime-lora-updating",
    ]
    with RemoteServer(flags, model=adapters["base"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120, max_retries=0)


def complete(client, model: str, max_tokens: int = MAX_TOKENS) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.model == model
    return out.choices[0].text


def load(server, name: str, path: str, headers: dict | None = None) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(
        server.url + "/v1/load_lora_adapter",
        json=body,
        headers=AUTH if headers is None else headers,
        timeout=120,
    )


def unload(server, name: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=60
    )


def assert_error(response: httpx.Response, status: int, *words: str) -> None:
    """An OpenAI-shaped error with this status whose message has every word."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == ("NotFoundError" if status == 404 else "invalid_request_error")
    for word in words:
        assert word in error["message"], (word, error["message"])


def test_models_lists_adapters_after_the_base_model(server, adapters):
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [m["id"] for m in models] == [BASE, "a1"]
    assert models[0]["parent"] is None
    assert models[1]["parent"] == BASE and models[1]["root"] == adapters["a1"]


def test_model_name_selects_the_adapter(client, reference):
    for name in (None, "a1"):
        assert complete(client, name or BASE) == reference[name, "completion"], name
        chat = client.chat.completions.create(
            model=name or BASE,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.model == (name or BASE)
        assert chat.choices[0].message.content == reference[name, "chat"], name


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "no-such-adapter")
    assert info.value.body["type"] == "NotFoundError"
    assert "no-such-adapter" in info.value.body["message"]


def test_load_at_run_time_then_use(server, client, adapters, reference):
    response = load(server, "a2", "a2")  # relative: under --lora-root
    assert response.status_code == 200 and "a2" in response.text
    ids = [m.id for m in client.models.list().data]
    assert ids == [BASE, "a1", "a2"]
    assert complete(client, "a2") == reference["a2", "completion"]
    assert_error(load(server, "a2", adapters["a2"]), 400, "already")
    assert_error(load(server, BASE, adapters["a2"]), 400, "already")


def test_unload_then_404_while_a_running_request_finishes(server, client, reference):
    assert load(server, "a2-gone", "a2").status_code == 200
    stream = client.completions.create(
        model="a2-gone",
        prompt=PROMPT,
        max_tokens=LONG_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # running now
    response = unload(server, "a2-gone")
    assert response.status_code == 200, response.text
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["a2", "long"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "a2-gone")
    assert "a2-gone" not in [m.id for m in client.models.list().data]
    assert_error(unload(server, "a2-gone"), 404, "a2-gone")


def test_paths_outside_the_root_are_refused(server, adapters):
    assert_error(load(server, "x", adapters["a1"]), 400, "outside", "--lora-root")
    assert_error(load(server, "x", "../outside/a1"), 400, "outside")
    assert_error(load(server, "x", "escape"), 400, "outside")  # a symlink out of the root
    assert_error(load(server, "x", "no-such-dir"), 400, "no such adapter directory")


def test_malformed_adapters_are_400_naming_the_reason(server):
    assert_error(load(server, "x", "bad-json"), 400, "adapter_config.json", "not JSON")
    assert_error(load(server, "x", "rank16"), 400, "rank 16", "max_lora_rank=8")
    assert_error(load(server, "x", "no-module"), 400, "mlp.nonexistent")


def test_load_and_unload_need_the_api_key(server):
    assert load(server, "x", "a2", headers={}).status_code == 401
    response = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert response.status_code == 401


def test_load_while_requests_run(server, client, reference):
    """A load does not disturb requests running with other adapters."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            assert complete(client, "a1") == reference["a1", "completion"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    assert load(server, "a2-race", "a2").status_code == 200
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert complete(client, "a2-race") == reference["a2", "completion"]


def test_server_still_serves_after_the_errors(server, client, reference):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert complete(client, BASE) == reference[None, "completion"]
    assert complete(client, "a1") == reference["a1", "completion"]
    assert "x" not in [m.id for m in client.models.list().data]


EMBED_INPUTS = ["w5 w17 w33", "w9 w41"]


@pytest.fixture(scope="module")
def embed_reference(adapters) -> dict[str | None, list]:
    """xlm's offline pooling engine: adapter name or None -> the inputs' vectors."""
    llm = xlm.LLM(model=adapters["base"], runner="pooling", **LORA_ENGINE)
    out = {}
    for name in (None, "a1"):
        lora = None if name is None else xlm.LoRARequest(name, 1, adapters[name])
        outputs = llm.embed(EMBED_INPUTS, use_tqdm=False, lora_request=lora)
        out[name] = [o.outputs.data for o in outputs]
    del llm
    assert not np.allclose(out[None][0], out["a1"][0], atol=1e-3)  # the adapter matters
    return out


@pytest.fixture(scope="module")
def pooling_server(adapters, embed_reference):
    """A pooling server with a1 from the start and no runtime loading (no --lora-root)."""
    flags = [*ENGINE_FLAGS, "--runner", "pooling", "--lora-modules", f"a1={adapters['a1']}"]
    with RemoteServer(flags, model=adapters["base"]) as srv:
        yield srv


def test_without_the_flag_there_are_no_load_routes(pooling_server):
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        response = httpx.post(
            f"{pooling_server.url}/v1/{route}", json={"lora_name": "a1", "lora_path": "a1"}
        )
        assert_error(response, 404)


def test_embeddings_select_the_adapter(pooling_server, embed_reference):
    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="none", max_retries=0)
    for name in (None, "a1"):
        out = client.embeddings.create(model=name or BASE, input=EMBED_INPUTS)
        assert out.model == (name or BASE)
        got = [d.embedding for d in sorted(out.data, key=lambda d: d.index)]
        for vector, want in zip(got, embed_reference[name]):
            np.testing.assert_allclose(vector, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="a2", input=EMBED_INPUTS)


def xlm_command(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1")
    return subprocess.run(
        [sys.executable, "-m", "xlm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
        timeout=timeout,
    )


def test_a_bad_start_up_adapter_fails_the_start(adapters):
    proc = xlm_command(
        "serve",
        adapters["base"],
        "--port",
        "0",
        *ENGINE_FLAGS,
        "--lora-modules",
        f"a1={adapters['a1']}",
        f"big={adapters['rank16']}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("xlm serve: error: --lora-modules big=") and "rank 16" in last


def test_run_batch_selects_adapters_by_model(adapters, reference, tmp_path):
    def line(custom_id: str, model: str) -> dict:
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        body["ignore_eos"] = True
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}

    records = [line("one", "a1"), line("two", "a2"), line("nope", "nope"), line("base", BASE)]
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = xlm_command(
        "run-batch",
        "-i",
        str(infile),
        "-o",
        str(outfile),
        "--model",
        adapters["base"],
        *ENGINE_FLAGS,
        "--lora-modules",
        f"a1={adapters['a1']}",
        f"a2={adapters['a2']}",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # one record failed
    assert "1 of 4 records failed" in proc.stderr
    results = [json.loads(r) for r in outfile.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["one", "two", "nope", "base"]
    texts = {r["custom_id"]: r["response"]["body"].get("choices", [{}])[0] for r in results}
    assert texts["one"]["text"] == reference["a1", "completion"]
    assert texts["two"]["text"] == reference["a2", "completion"]
    assert texts["base"]["text"] == reference[None, "completion"]
    assert results[1]["response"]["body"]["model"] == "a2"
    nope = results[2]
    assert nope["response"]["status_code"] == 404 and nope["error"]["code"] == "model_not_found"
    assert "nope" in nope["error"]["message"]
