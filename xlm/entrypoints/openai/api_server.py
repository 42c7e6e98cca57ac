"""The OpenAI-compatible HTTP server: FastAPI app over AsyncLLM, run by uvicorn.

Start it with `xlm serve MODEL [flags]` or `python -m xlm.entrypoints.openai.api_server
MODEL [flags]`. SIGTERM (or Ctrl-C) drains: new requests are refused, in-flight ones may
finish within --shutdown-timeout, the rest end with finish_reason "abort", then the
engine process is reaped.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import xlm
from xlm import envs
from xlm.entrypoints.openai.admission import (
    RETRY_AFTER_S,
    request_cost,
)
from xlm.entrypoints.openai.engine_setup import ServerState, build_engine
from xlm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES
from xlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from xlm.entrypoints.openai.security import BodySizeLimit, api_key_ok, needs_api_key
from xlm.entrypoints.openai.serving_engine import OpenAIError, error_from_exception
from xlm.logger import init_logger

logger = init_logger(__name__)


def error_response(error: OpenAIError) -> JSONResponse:
    """An OpenAI-shaped JSON error with its status."""
    return JSONResponse(error.to_response().model_dump(), status_code=int(error.status))


def _status_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "NotFoundError",
        405: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        msg = err.get("msg", "invalid")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param


async def parse_body(raw_request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body into a protocol model; OpenAIError (400/415) for anything else."""
    content_type = raw_request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise OpenAIError(
            "Unsupported Media Type: only 'application/json' is allowed",
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        )
    body = await raw_request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(f"The request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _validation_message(e.errors())
        raise OpenAIError(message, param=param) from None


async def _with_disconnect(raw_request: Request, work: Awaitable[Any]) -> Any:
    """Run work; cancel it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.ensure_future(listen())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


class _BodySchemas:
    """Request-body schemas in the app's OpenAPI document.

    The routes parse their bodies by hand (for 415s and OpenAI-shaped 400s), so FastAPI
    cannot see the models; each route declares its model's JSON schema here, and the
    models it refers to go under components/schemas.
    """

    REF = "#/components/schemas/{model}"

    def __init__(self, app: FastAPI) -> None:
        self.defs: dict[str, Any] = {}
        base = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                schema = base()
                schema.setdefault("components", {}).setdefault("schemas", {}).update(self.defs)
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]

    def operation(self, model: type[BaseModel]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template=self.REF)
        self.defs.update(schema.pop("$defs", {}))
        content = {"application/json": {"schema": schema}}
        return {"requestBody": {"required": True, "content": content}}


def build_app(args: argparse.Namespace, engine: Any, registry: Any = None) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLM) with the parsed server flags."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        interval = envs.XLM_LOG_STATS_INTERVAL or 0
        if interval > 0 and not args.disable_log_stats:

            async def log_stats() -> None:
                while True:
                    await asyncio.sleep(interval)
                    engine.do_log_stats()

            task = asyncio.create_task(log_stats())
        yield
        if task is not None:
            task.cancel()

    app = FastAPI(lifespan=lifespan, title="xlm", version=xlm.__version__)
    state = ServerState(args, engine, registry)
    app.state.xlm = state
    origins = list(getattr(args, "allowed_origins", None) or [])
    allow_credentials = bool(getattr(args, "allow_credentials", False))
    if allow_credentials and "*" in origins:
        raise ValueError("--allow-credentials cannot be used with the '*' origin")

    api_key = args.api_key
    protect_metrics = bool(getattr(args, "metrics_require_api_key", False))

    @app.middleware("http")
    async def gate(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if api_key is not None and needs_api_key(path, request.method, protect_metrics):
            if not api_key_ok(request.headers.get("authorization"), api_key):
                return error_response(
                    OpenAIError(
                        "Invalid or missing API key",
                        HTTPStatus.UNAUTHORIZED,
                        "authentication_error",
                        code="invalid_api_key",
                    )
                )
        if request.method != "OPTIONS" and path.startswith("/v1"):
            if state.draining:
                return error_response(
                    OpenAIError(
                        "The server is shutting down",
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        "service_unavailable",
                    )
                )
        return await call_next(request)

    if origins:  # outside the key check, so preflights and error responses carry CORS
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials=allow_credentials,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    # Outermost: a body over the limit is refused before anything reads it.
    app.add_middleware(
        BodySizeLimit,
        max_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
    )

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(FastAPIValidationError)
    async def on_validation_error(request: Request, exc: FastAPIValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(OpenAIError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        return error_response(OpenAIError(str(exc.detail), status, _status_type(status)))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(error_from_exception(exc))

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(
                OpenAIError(
                    "The engine is dead",
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    code="engine_dead",
                )
            )
        return Response(status_code=200)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": xlm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if registry is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(state.models.show_available_models().model_dump())

    admission = state.admission
    body_schemas = _BodySchemas(app)

    async def _serve(raw_request: Request, model: type[BaseModel], handler: Any) -> Response:
        request = await parse_body(raw_request, model)
        cost = request_cost(request)
        if not admission.try_acquire(cost):
            response = error_response(
                OpenAIError(
                    f"The server is overloaded: {admission.in_flight} sequences are running or "
                    f"waiting (limit {admission.capacity}); retry later",
                    HTTPStatus.TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    code="too_many_requests",
                )
            )
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        streaming = False
        try:
            if engine.errored:
                raise engine.dead_error
            if getattr(request, "stream", False):
                stream = await handler(request)
                streaming = True
                return StreamingResponse(
                    admission.guard_stream(stream, cost), media_type="text/event-stream"
                )
            result = await _with_disconnect(raw_request, handler(request))
        except Exception as e:
            return error_response(error_from_exception(e))
        finally:
            if not streaming:
                admission.release(cost)
        if result is None:  # client went away
            return Response(status_code=499)
        return JSONResponse(result.model_dump())

    @app.post("/v1/completions", openapi_extra=body_schemas.operation(CompletionRequest))
    async def completions(raw_request: Request) -> Response:
        return await _serve(raw_request, CompletionRequest, state.completion.create_completion)

    @app.post("/v1/chat/completions", openapi_extra=body_schemas.operation(ChatCompletionRequest))
    async def chat_completions(raw_request: Request) -> Response:
        return await _serve(raw_request, ChatCompletionRequest, state.chat.create_chat_completion)

    @app.post("/tokenize", openapi_extra=body_schemas.operation(TokenizeRequest))
    async def tokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, TokenizeRequest)
        response = await state.ctx.run_blocking(state.models.tokenize, request)
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.post("/detokenize", openapi_extra=body_schemas.operation(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, DetokenizeRequest)
        return JSONResponse(state.models.detokenize(request).model_dump())

    return app


async def serve_http(app: FastAPI, args: argparse.Namespace, engine: Any) -> None:
    """Run uvicorn until a signal; drain in-flight requests first."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = _DrainingServer(config, app.state.xlm, args.shutdown_timeout)
    await server.serve()


class _DrainingServer:
    """A uvicorn server whose first SIGTERM/SIGINT drains requests before exiting."""

    def __init__(self, config: Any, state: ServerState, shutdown_timeout: float) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if outer.draining_task is None and not self.should_exit:
                    loop = outer.loop
                    if loop is not None:
                        loop.call_soon_threadsafe(outer.start_drain)
                        return
                super().handle_exit(sig, frame)

        self.server = Server(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.draining_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start_drain(self) -> None:
        if self.draining_task is None:
            self.draining_task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        engine = self.state.engine
        logger.info(
            "Shutting down: refusing new requests, waiting up to %.0f s for %d in flight",
            self.shutdown_timeout,
            engine.num_unfinished_requests,
        )
        self.state.draining = True
        for listener in getattr(self.server, "servers", []) or []:
            listener.close()  # stop accepting connections; open ones stay
        deadline = time.monotonic() + self.shutdown_timeout
        while engine.num_unfinished_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = await engine.abort_all()
        if aborted:
            logger.info("Aborted %d requests still running at the deadline", len(aborted))
            await asyncio.sleep(0.5)  # let their handlers send the final chunks
        self.server.should_exit = True

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()


def run_server(args: argparse.Namespace) -> int:
    """Start the engine, serve HTTP until SIGTERM/SIGINT, then reap the engine process."""
    logger.info(
        "xlm %s serving %s on http://%s:%d", xlm.__version__, args.model, args.host, args.port
    )
    # SIGTERM while the model loads exits cleanly too (uvicorn takes over once serving).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine, registry = build_engine(args)
    try:
        app = build_app(args, engine, registry)
        gc.collect()
        gc.freeze()  # long-lived start-up objects: out of the collector's way
        asyncio.run(serve_http(app, args, engine))
    finally:
        engine.shutdown()
        logger.info("Server stopped; engine process reaped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m xlm.entrypoints.openai.api_server MODEL [flags]`."""
    from xlm.entrypoints.openai.cli_args import parse_serve_args

    return run_server(parse_serve_args(argv))


if __name__ == "__main__":
    sys.exit(main())
