"""The probes: /health and /ping 200 while the engine serves, 503 in OpenAI's error shape
once it is dead; /version names xlm's."""

from __future__ import annotations

import xlm
from tests.entrypoints.openai.test_api_server import make_client


def test_probes_follow_the_engine_and_version_is_xlms(tokenizer):
    with make_client(tokenizer) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ping").status_code == 200
        assert c.get("/version").json() == {"version": xlm.__version__}
        c.app.state.xlm.engine.errored = True
        for path in ("/health", "/ping"):
            r = c.get(path)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "engine_dead"
