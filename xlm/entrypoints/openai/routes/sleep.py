"""Sleep mode and weight updates (vLLM's shapes): POST /sleep?level=1, POST /wake_up,
GET /is_sleeping, and POST /update_weights {"path": ...}.

They are admin routes: behind the API key like every route but the probes. While the
engine sleeps, new inference requests are answered 503 (api_server's gate); sleep and
update_weights need an idle engine (409 while requests run).
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xlm.engine.exceptions import EngineDeadError
from xlm.entrypoints.openai.protocol import UpdateWeightsRequest
from xlm.entrypoints.openai.routes.common import body_schema, parse_body, server_state
from xlm.entrypoints.openai.serving_engine import OpenAIError

router = APIRouter()


def _engine_error(error: RuntimeError, param: str | None = None) -> OpenAIError:
    """The engine core's refusal (a ValueError there, named in the utility's answer) as a
    400, or 409 when the engine is busy."""
    text = str(error)
    if text.startswith("EngineBusyError: "):
        return OpenAIError(
            text.removeprefix("EngineBusyError: "), HTTPStatus.CONFLICT, "conflict_error"
        )
    if text.startswith("ValueError: "):
        return OpenAIError(text.removeprefix("ValueError: "), param=param)
    raise error


def _parse_level(raw: str | None) -> int:
    if raw is None:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise OpenAIError(
            f"level={raw!r} is invalid: 1 (weights to host memory, KV cache dropped) or 2 "
            "(weights and KV cache dropped)",
            param="level",
        ) from None


@router.post("/sleep")
async def sleep(raw_request: Request) -> Response:
    engine = server_state(raw_request).engine
    level = _parse_level(raw_request.query_params.get("level"))
    try:
        await engine.sleep(level)
    except EngineDeadError:
        raise
    except RuntimeError as e:
        raise _engine_error(e, param="level") from None
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(raw_request: Request) -> Response:
    await server_state(raw_request).engine.wake_up()
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(raw_request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": await server_state(raw_request).engine.is_sleeping()})


@router.post("/update_weights", openapi_extra=body_schema(UpdateWeightsRequest))
async def update_weights(raw_request: Request) -> Response:
    state = server_state(raw_request)
    request = await parse_body(raw_request, UpdateWeightsRequest)
    try:
        await state.engine.update_weights(request.path)
    except EngineDeadError:
        raise
    except RuntimeError as e:
        raise _engine_error(e, param="path") from None
    return Response(status_code=200)
