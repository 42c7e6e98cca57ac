"""Models by Hugging Face name: resolved from a hub cache the test builds (no network).

The cache is laid out as huggingface_hub writes it (blobs named by content hash,
snapshots/<commit>/ of symlinks, refs/<branch> holding the commit), and xlm's real
resolution code (`snapshot_download(local_files_only=...)`) reads it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import xlm
from tests.engine.reference import TINY_ENGINE, cli_engine_flags, tiny_engine
from xlm.models.builtin import resolve_model_name

REPO = "some-org/tiny-model"
PROMPT = "w10 w20 w30 w40 w50"
COMMIT_MAIN = "a" * 40
COMMIT_OLD = "b" * 40


def add_snapshot(cache: str, repo: str, src: str, commit: str, ref: str | None, skip=()):
    """Copy the files of `src` into the hub cache as snapshot `commit` (and refs/`ref`)."""
    repo_dir = os.path.join(cache, "models--" + repo.replace("/", "--"))
    blobs = os.path.join(repo_dir, "blobs")
    snap = os.path.join(repo_dir, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if any(name.endswith(s) for s in skip):
            continue
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        blob = os.path.join(blobs, hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
    if ref is not None:
        os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
        with open(os.path.join(repo_dir, "refs", ref), "w") as f:
            f.write(commit)
    return snap


@pytest.fixture(scope="module")
def hub_home(tiny_checkpoint, tmp_path_factory) -> str:
    """An HF_HOME whose hub cache holds REPO: main (llama weights) and an older commit."""
    home = str(tmp_path_factory.mktemp("hf_home"))
    cache = os.path.join(home, "hub")
    add_snapshot(cache, REPO, tiny_checkpoint("llama"), COMMIT_MAIN, "main")
    add_snapshot(cache, REPO, tiny_checkpoint("qwen3"), COMMIT_OLD, None)
    # A repo whose cached snapshot has only its config: no safetensors to serve.
    add_snapshot(
        cache,
        "some-org/no-weights",
        tiny_checkpoint("llama"),
        COMMIT_MAIN,
        "main",
        (".safetensors",),
    )
    return home


@pytest.fixture
def offline(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", hub_home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return os.path.join(hub_home, "hub")


def test_name_resolves_to_the_cached_snapshot_of_main(offline):
    path = resolve_model_name(REPO)
    assert os.path.realpath(path) == os.path.realpath(
        os.path.join(offline, "models--some-org--tiny-model", "snapshots", COMMIT_MAIN)
    )


def test_revision_selects_another_snapshot(offline):
    path = resolve_model_name(REPO, revision=COMMIT_OLD)
    assert os.path.basename(path) == COMMIT_OLD


def test_download_dir_is_the_cache_read(offline, hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", os.path.join(hub_home, "elsewhere"))
    with pytest.raises(FileNotFoundError):
        resolve_model_name(REPO)
    assert os.path.basename(resolve_model_name(REPO, download_dir=offline)) == COMMIT_MAIN


def test_uncached_model_offline_names_model_and_path(offline):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_name("some-org/not-there")
    msg = str(e.value)
    assert "some-org/not-there" in msg
    assert os.path.join(offline, "models--some-org--not-there") in msg
    assert "HF_HUB_OFFLINE" in msg


def test_cached_snapshot_without_safetensors_is_refused(offline):
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        resolve_model_name("some-org/no-weights")
    # Dummy weights need only the config, which is cached.
    path = resolve_model_name("some-org/no-weights", load_format="dummy")
    assert os.path.isfile(os.path.join(path, "config.json"))


def test_llm_by_name_generates_like_the_local_directory(offline, tiny_checkpoint):
    params = xlm.SamplingParams(temperature=0.0, max_tokens=6)
    by_name = xlm.LLM(model=REPO, **TINY_ENGINE)
    # The engine runs from the snapshot of main in the cache.
    assert by_name.llm_engine.config.model_config.model.endswith(COMMIT_MAIN)
    local = xlm.LLM(model=tiny_checkpoint("llama"), **TINY_ENGINE)
    a = by_name.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    b = local.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def _cli(hub_home: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1", HF_HOME=hub_home, HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "xlm.entrypoints.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
def test_cli_generate_by_name_offline(hub_home, tiny_checkpoint):
    flags = [PROMPT, "--max-tokens", "6", "--temperature", "0", *cli_engine_flags(TINY_ENGINE)]
    result = _cli(hub_home, "--model", REPO, *flags)
    assert result.returncode == 0, result.stderr
    llm = tiny_engine(tiny_checkpoint("llama"))
    params = xlm.SamplingParams(temperature=0.0, max_tokens=6)
    assert result.stdout == llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text + "\n"

    missing = _cli(hub_home, "--model", "some-org/missing-model", *flags)
    assert missing.returncode != 0
    assert "some-org/missing-model" in missing.stderr
    assert os.path.join(hub_home, "hub", "models--some-org--missing-model") in missing.stderr
    assert "Traceback" not in missing.stderr
