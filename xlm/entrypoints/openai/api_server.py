"""The OpenAI-compatible HTTP server: FastAPI app over AsyncLLM, run by uvicorn.

Start it with `xlm serve MODEL [flags]` or `python -m xlm.entrypoints.openai.api_server
MODEL [flags]`. SIGTERM (or Ctrl-C) drains: new requests are refused, in-flight ones may
finish within --shutdown-timeout, the rest end with finish_reason "abort", then the
engine process is reaped. The routes are in `routes/`, one router per family; this module
assembles the app (guards, error handlers, routers) and runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import xlm
from xlm import envs
from xlm.entrypoints.openai.cli_args import parse_serve_args
from xlm.entrypoints.openai.engine_setup import ServerState, build_engine
from xlm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES
from xlm.entrypoints.openai.routes import ROUTERS
from xlm.entrypoints.openai.routes.common import (
    error_response,
    install_body_schemas,
    status_type,
)
from xlm.entrypoints.openai.routes.messages import MessagesErrorShape
from xlm.entrypoints.openai.routes.models import lora_router
from xlm.entrypoints.openai.routes.score import UNVERSIONED_PATHS
from xlm.entrypoints.openai.security import BodySizeLimit, needs_api_key, request_key_ok
from xlm.entrypoints.openai.serving_engine import (
    OpenAIError,
    error_from_exception,
    error_from_validation,
)
from xlm.logger import init_logger

logger = init_logger(__name__)


def build_app(args: argparse.Namespace, engine: Any, registry: Any = None) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLM) with the parsed server flags."""
    app = FastAPI(lifespan=_stats_logging(args, engine), title="xlm", version=xlm.__version__)
    state = ServerState(args, engine, registry)
    app.state.xlm = state
    _install_guards(app, args, state)
    app.add_middleware(MessagesErrorShape)  # outermost: Anthropic's errors on /v1/messages
    _install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if getattr(args, "allow_runtime_lora_updating", False):
        app.include_router(lora_router)
    install_body_schemas(app)
    return app


def _stats_logging(args: argparse.Namespace, engine: Any) -> Any:
    """The app's lifespan: read the engine's outputs from the start (its stats report the
    programs compiling in the background before any request), and log the engine's stats
    every XLM_LOG_STATS_INTERVAL seconds."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start_output_handler()
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

    return lifespan


def _install_guards(app: FastAPI, args: argparse.Namespace, state: ServerState) -> None:
    """API key, draining 503s, CORS and the body-size limit, outermost last."""
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
            if not request_key_ok(path, request.headers, api_key):
                return error_response(
                    OpenAIError(
                        "Invalid or missing API key",
                        HTTPStatus.UNAUTHORIZED,
                        "authentication_error",
                        code="invalid_api_key",
                    )
                )
        if request.method != "OPTIONS" and (path.startswith("/v1") or path in UNVERSIONED_PATHS):
            if state.draining:
                return error_response(
                    OpenAIError(
                        "The server is shutting down",
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        "service_unavailable",
                    )
                )
            if request.method == "POST" and getattr(state.engine, "sleeping", False) is True:
                return error_response(
                    OpenAIError(
                        "The engine is asleep: POST /wake_up first",
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        "service_unavailable",
                        code="engine_sleeping",
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


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server in OpenAI's error shape."""

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(FastAPIValidationError)
    async def on_validation_error(request: Request, exc: FastAPIValidationError) -> JSONResponse:
        return error_response(error_from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        return error_response(OpenAIError(str(exc.detail), status, status_type(status)))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(error_from_exception(exc))


async def serve_http(app: FastAPI, args: argparse.Namespace, engine: Any) -> None:
    """Run uvicorn until a signal; drain in-flight requests first."""
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    await app.state.xlm.models.check_lora_modules()  # a bad adapter fails the start
    server = _DrainingServer(config, app.state.xlm, args.shutdown_timeout)
    await server.serve()


class _DrainingServer:
    """A uvicorn server whose first SIGTERM/SIGINT drains requests before exiting."""

    def __init__(self, config: Any, state: ServerState, shutdown_timeout: float) -> None:
        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if outer.draining_task is None and not self.should_exit:
                    loop = outer.loop
                    if loop is not None:
                        loop.call_soon_threadsafe(outer.start_drain)
                        return
                super().handle_exit(sig, frame)

            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                # The bound address, whatever uvicorn's log level: with --port 0 this line is
                # how a caller learns the port the system chose.
                for listener in self.servers:
                    for sock in listener.sockets:
                        host, port = sock.getsockname()[:2]
                        logger.info("Listening on http://%s:%d", host, port)

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


def run_server(args: argparse.Namespace, config: Any = None, engine_process: Any = None) -> int:
    """Start the engine, serve HTTP until SIGTERM/SIGINT, then reap the engine process.

    `config` and `engine_process`: what `xlm serve` started before importing this module
    (see `build_engine`)."""
    logger.info(
        "xlm %s serving %s on http://%s:%d", xlm.__version__, args.model, args.host, args.port
    )
    # SIGTERM while the model loads exits cleanly too (uvicorn takes over once serving).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine, registry = build_engine(args, config, engine_process)
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
    return run_server(parse_serve_args(argv))


if __name__ == "__main__":
    sys.exit(main())
