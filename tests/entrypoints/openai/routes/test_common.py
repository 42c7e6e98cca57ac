"""The routes' shared pieces: an OpenAIError answered in OpenAI's shape with its status,
and the error type each status gets."""

from __future__ import annotations

import json

from xlm.entrypoints.openai.routes.common import error_response, status_type
from xlm.entrypoints.openai.serving_engine import OpenAIError


def test_error_response_has_openais_shape_and_the_status():
    response = error_response(OpenAIError("n=9 exceeds 4", param="n", code="too_many"))
    assert response.status_code == 400
    assert json.loads(response.body) == {
        "error": {
            "message": "n=9 exceeds 4",
            "type": "invalid_request_error",
            "param": "n",
            "code": "too_many",
        }
    }


def test_status_types():
    assert status_type(401) == "authentication_error"
    assert status_type(429) == "rate_limit_error"
    assert status_type(503) == "service_unavailable"
    assert status_type(502) == "server_error"
    assert status_type(422) == "invalid_request_error"
