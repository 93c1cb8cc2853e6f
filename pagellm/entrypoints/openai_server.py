"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``: the app, its routes and guards.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as SSE),
``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health``, ``GET /version``, ``POST /tokenize``,
``POST /detokenize``, ``GET /metrics`` (Prometheus). Each endpoint's work is its ``serving_*`` module's
(vLLM's layout); errors use OpenAI's body ``{"error": {message, type, param, code}}``. A client that
disconnects aborts its request (its blocks are freed before the next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagellm
from pagellm.engine.core_client import AsyncEngineClient, keep_torch_out
from pagellm.engine.protocol import EngineClient, EngineDeadError
from pagellm.entrypoints.chat_utils import MediaConnector
from pagellm.entrypoints.openai_protocol import (
    CONTENT_FORMATS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_responses,
)
from pagellm.entrypoints.server_metrics import ServerMetrics
from pagellm.entrypoints.serving_chat import OpenAIServingChat
from pagellm.entrypoints.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.serving_models import OpenAIServingModels
from pagellm.entrypoints.serving_score import OpenAIServingScores
from pagellm.entrypoints.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20  # far above any prompt max_model_len allows; a 413 before the body is read


class _BodyLimit:
    """Pure ASGI (Starlette's BaseHTTPMiddleware would hide client disconnects): a request whose
    Content-Length exceeds the limit gets an OpenAI-shaped 413 without its body being read."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if length.isdigit() and int(length) > self.limit:
                await _error(f"The request body of {int(length)} bytes exceeds the limit of {self.limit} bytes.",
                             413, "BadRequestError")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(message: str, status: int, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


class OpenAIServer:
    """Builds the FastAPI app for one ``AsyncLLM`` or ``AsyncEngineClient``: one serving object per
    endpoint family, all sharing the served names and the metrics."""

    def __init__(self, engine: EngineClient, model_name: str, api_key: str | None = None,
                 chat_template_content_format: str = "auto", media: MediaConnector | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> None:
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                             f"got {chat_template_content_format!r}")
        self.engine = engine
        self.api_key = api_key
        self.models = OpenAIServingModels(engine, model_name)
        self.metrics = ServerMetrics(engine, model_name)
        common = (engine, self.models, self.metrics, chat_template_content_format, media)
        self.completion = OpenAIServingCompletion(*common)
        self.chat = OpenAIServingChat(*common, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
        self.embedding = OpenAIServingEmbedding(*common)
        self.scores = OpenAIServingScores(*common)
        self.tokenization = OpenAIServingTokenization(*common)
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pagellm", version=pagellm.__version__)
        app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
        self._add_error_handlers(app)
        v1, keyed = self._guards()
        self._add_service_routes(app, v1, keyed)
        self._add_api_routes(app, v1, keyed)
        return app

    @staticmethod
    def _add_error_handlers(app: FastAPI) -> None:
        @app.exception_handler(APIError)
        async def _api_error(_: Request, e: APIError) -> JSONResponse:
            return _error(e.message, e.status, e.type, e.param, e.code)

        @app.exception_handler(RequestValidationError)
        async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
            first = e.errors()[0] if e.errors() else {}
            loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
            return _error(f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(e), 400,
                          "BadRequestError", loc)

        @app.exception_handler(EngineDeadError)
        async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
            return _error(str(e), 503, "ServiceUnavailableError")

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
            """Routing's own errors (an unknown URL, a method the route lacks) in OpenAI's body."""
            where = f"{request.method} {request.url.path}"
            message = {404: f"Invalid URL ({where})", 405: f"Method not allowed ({where})"}.get(
                e.status_code, str(e.detail))
            response = _error(message, e.status_code, "invalid_request_error")
            response.headers.update(e.headers or {})  # (405's Allow)
            return response

    def _guards(self) -> tuple[list[Any], list[Any]]:
        """``(v1, keyed)``: the dependencies of the API routes (the key, and a running engine) and
        of the service routes that need only the key. With --api-key everything but /health,
        /version and the OpenAPI document needs it."""
        server = self
        # A dependency, not HTTP middleware: Starlette's BaseHTTPMiddleware hides client
        # disconnects from ``Request.is_disconnected``, which abort-on-disconnect relies on.
        expected = f"Bearer {server.api_key}".encode() if server.api_key else None

        async def key_guard(request: Request) -> None:
            # Constant time: the comparison's duration must not tell how much of a guess was right.
            given = request.headers.get("authorization", "").encode()
            if expected is not None and not hmac.compare_digest(given, expected):
                raise APIError("Incorrect or missing API key.", 401, "AuthenticationError", code="invalid_api_key")

        async def guard(request: Request) -> None:
            await key_guard(request)
            if not server.engine.is_running:
                raise APIError("The engine is not running.", 503, "ServiceUnavailableError")

        return [Depends(guard)], [Depends(key_guard)]

    def _add_service_routes(self, app: FastAPI, v1: list[Any], keyed: list[Any]) -> None:
        """Health, version, models, LoRA adapters, metrics and the step trace."""
        server = self

        @app.get("/health", response_class=Response,
                 responses={200: {"description": "The engine is running (empty body)"}, **error_responses(503)})
        async def health() -> Response:
            try:
                await server.engine.check_health()
            except EngineDeadError as e:
                return _error(f"The engine is not running: {e}", 503, "ServiceUnavailableError")
            return Response(status_code=200)

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": pagellm.__version__}

        @app.get("/v1/models", dependencies=v1, responses=error_responses(401, 503))
        async def models() -> dict[str, Any]:
            return await server.models.list_models()

        @app.post("/v1/load_lora_adapter", dependencies=v1, responses=error_responses(400, 401))
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, Any]:
            """Check and register an adapter (its files are read in a thread, not in the engine's step)."""
            return await server.models.load_lora(body.lora_name, body.lora_path)

        @app.post("/v1/unload_lora_adapter", dependencies=v1, responses=error_responses(400, 401, 404, 409))
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, Any]:
            """Unregister an adapter; 409 while requests using it run (they are never cut short)."""
            return await server.models.unload_lora(body.lora_name)

        @app.get("/metrics", dependencies=keyed, responses=error_responses(401))
        async def metrics() -> Response:
            return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")

        @app.get("/debug/trace", dependencies=keyed, responses=error_responses(401, 404))
        async def debug_trace() -> Response:
            """The step trace so far (Chrome Trace JSON; ``pagellm trace`` renders it); 404 unless
            the server was started with ``--trace`` or ``--trace-out FILE``."""
            trace = await asyncio.to_thread(server.engine.get_trace_now)
            if trace is None:
                return _error("the step trace is off: start the server with --trace or --trace-out FILE", 404,
                              "NotFoundError")
            return Response(json.dumps(trace, separators=(",", ":")), media_type="application/json")

    def _add_api_routes(self, app: FastAPI, v1: list[Any], keyed: list[Any]) -> None:
        """Tokenization and the OpenAI endpoints, each handed to its serving object."""
        server = self

        @app.post("/tokenize", dependencies=keyed, responses=error_responses(400, 401, 404))
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            return server.tokenization.tokenize(body)

        @app.post("/detokenize", dependencies=keyed, responses=error_responses(400, 401, 404))
        async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
            return server.tokenization.detokenize(body)

        @app.post("/v1/embeddings", dependencies=v1, responses=error_responses(400, 401, 404, 503))
        async def embeddings(body: EmbeddingRequest, request: Request):
            return await server.embedding.create_embedding(body, request)

        for path in ("/v1/score", "/score"):
            @app.post(path, dependencies=v1, responses=error_responses(400, 401, 404, 503))
            async def score(body: ScoreRequest, request: Request):
                return await server.scores.create_score(body, request)

        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            @app.post(path, dependencies=v1, responses=error_responses(400, 401, 404, 503))
            async def rerank(body: RerankRequest, request: Request):
                return await server.scores.create_rerank(body, request)

        @app.post("/v1/completions", dependencies=v1, responses=error_responses(400, 401, 404, 503))
        async def completions(body: CompletionRequest, request: Request):
            return await server.completion.create_completion(body, request)

        @app.post("/v1/chat/completions", dependencies=v1, responses=error_responses(400, 401, 404, 503))
        async def chat(body: ChatCompletionRequest, request: Request):
            return await server.chat.create_chat_completion(body, request)


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              chat_template_content_format: str = "auto", media: MediaConnector | None = None,
              reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    return OpenAIServer(engine, model_name, api_key, chat_template_content_format, media, reasoning_parser,
                        tool_call_parser).app


def serve(engine: EngineClient, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, reuse_port: bool = False, chat_template_content_format: str = "auto",
          exit_on_engine_death: bool = False, media: MediaConnector | None = None,
          reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> None:
    """Run the server until interrupted, then shut the engine (client) down. ``reuse_port``: bind
    with SO_REUSEPORT, so several server processes share one port (the kernel spreads connections).
    ``exit_on_engine_death``: stop serving and exit with status 1 once the engine has died, so a
    supervisor (systemd ``Restart=on-failure``, a Kubernetes pod) starts a fresh one."""
    import socket
    import threading

    import uvicorn

    app = build_app(engine, model_name, api_key, chat_template_content_format, media, reasoning_parser,
                    tool_call_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    died = threading.Event()

    def watch() -> None:
        while not server.should_exit:
            if engine.dead_error is not None:
                logger.error("the engine died (%s); exiting (--exit-on-engine-death)", engine.dead_error)
                died.set()
                server.should_exit = True
                return
            time.sleep(0.5)

    if exit_on_engine_death:
        threading.Thread(target=watch, name="pagellm-engine-watch", daemon=True).start()
    try:
        if not reuse_port:
            server.run()
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal
        pass
    finally:
        engine.shutdown()
    if died.is_set():
        raise SystemExit(1)


def run_api_server(client_index: int, input_addr: str, output_addr: str, core_pid: int, model_name: str,
                   host: str, port: int, api_key: str | None, chat_template_content_format: str = "auto",
                   exit_on_engine_death: bool = False, media: MediaConnector | None = None,
                   reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> None:
    """One of ``--api-server-count`` front-end processes: an engine-core client with its own index,
    serving HTTP on the shared port."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    keep_torch_out()
    client = AsyncEngineClient(input_addr, output_addr, client_index, core_pid)
    client.wait_ready()
    serve(client, model_name, host, port, api_key, reuse_port=True,
          chat_template_content_format=chat_template_content_format, exit_on_engine_death=exit_on_engine_death,
          media=media, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
