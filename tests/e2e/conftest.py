"""Shared e2e fixtures: one real `xlm serve` process for the session, run-batch jobs."""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.server_utils import MODEL, RemoteServer

API_KEY = "test-key"
SERVED_NAMES = [MODEL, "smol"]


@pytest.fixture(scope="session")
def server():
    """The shared server (API key required on /v1/*, two served names)."""
    with RemoteServer(["--api-key", API_KEY, "--served-model-name", *SERVED_NAMES]) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    """Official openai client for the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def batch_job(tiny_checkpoint, tmp_path_factory):
    """make(name, records) -> (model, dir, input file, env): a run-batch job on the tiny Llama."""

    def make(name: str, records: list[dict]):
        tmp = tmp_path_factory.mktemp(name)
        infile = tmp / "in.jsonl"
        infile.write_text("".join(json.dumps(r) + "\n" for r in records))
        # The session's program cache (tests/conftest.py): jobs with the same engine flags,
        # in this module or another, load what the first one compiled.
        env = dict(os.environ, XLM_DISABLE_PROGRESS_BARS="1")
        return tiny_checkpoint("llama"), tmp, infile, env

    return make
