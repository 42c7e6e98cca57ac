"""One real `xlm serve` process for the whole session, shared by the server tests."""

from __future__ import annotations

import pytest

from tests.e2e.server_utils import MODEL, RemoteServer

API_KEY = "test-key"
SERVED_NAMES = [MODEL, "smol"]


@pytest.fixture(scope="session")
def server():
    """The shared server (API key required on /v1/*, two served names)."""
    pytest.importorskip("openai")
    try:
        from xlm.models.builtin import resolve_model_name

        resolve_model_name(MODEL)
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"built-in model unavailable: {e}")
    srv = RemoteServer(["--api-key", API_KEY, "--served-model-name", *SERVED_NAMES])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    """Official openai client for the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="session")
def tokenizer():
    """The served model's tokenizer."""
    from xlm.tokenizer import get_tokenizer

    return get_tokenizer(MODEL)
