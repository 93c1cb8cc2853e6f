"""``pagellm proxy``: one OpenAI-compatible endpoint in front of a prefill engine and a decode
engine (disaggregated prefill/decode with ``TcpConnector``; docs/kv_transfer.md).

For each completion or chat request the proxy makes a transfer id and sends, at the same time:

- to the prefill server: the request with ``max_tokens=1``, no streaming, and
  ``kv_transfer_params={"do_remote_decode": true, "transfer_id": ID, "remote_host": H,
  "remote_port": P}``: it computes the prompt and pushes its blocks to the decode engine's KV
  receiver at ``H:P``;
- to the decode server: the request as the client sent it, with ``kv_transfer_params=
  {"do_remote_prefill": true, "transfer_id": ID}``: it waits (holding no blocks) until the
  blocks are there, or its ``timeout_s`` passes and it computes the prompt itself.

The client gets the decode server's response, streamed as it comes. A failed prefill costs the
decode side its timeout, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class _Proxy:
    """The proxy's state: the two servers, the decode engine's KV receiver, one HTTP client."""

    def __init__(self, prefill_url: str, decode_url: str, kv_host: str, kv_port: int, timeout_s: float) -> None:
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.kv_host, self.kv_port = kv_host, kv_port
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    @staticmethod
    def auth(request: Request) -> dict[str, str]:
        value = request.headers.get("authorization")
        return {"authorization": value} if value else {}

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            resp = await self.client().post(self.prefill_url + path, json=body, headers=headers)
            if resp.status_code != 200:
                logger.warning("prefill server answered %d for %s: %s", resp.status_code,
                               body["kv_transfer_params"]["transfer_id"], resp.text[:200])
        except httpx.HTTPError as e:
            logger.warning("prefill server unreachable (%s): the decode server recomputes", e)

    async def relay(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON", "type": "BadRequestError"}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "body must be a JSON object", "type": "BadRequestError"}}, 400)
        tid = f"xfer-{uuid.uuid4().hex}"
        headers = self.auth(request)
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
        pre.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": tid,
                                                      "remote_host": self.kv_host, "remote_port": self.kv_port})
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        dec = dict(body, kv_transfer_params={"do_remote_prefill": True, "transfer_id": tid})
        task = asyncio.create_task(self.prefill(path, pre, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            req = self.client().build_request("POST", self.decode_url + path, json=dec, headers=headers)
            resp = await self.client().send(req, stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"decode server unreachable: {e}", "type": "ServiceUnavailable"}},
                                503)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        if not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, resp.status_code, out_headers)

        async def stream():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:  # (a client hang-up closes the decode request too: it aborts there)
                await resp.aclose()

        return StreamingResponse(stream(), resp.status_code, out_headers)

    async def healthy(self) -> bool:
        for url in (self.prefill_url, self.decode_url):
            try:
                if (await self.client().get(url + "/health")).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True


def build_proxy_app(prefill_url: str, decode_url: str, kv_host: str, kv_port: int,
                    timeout_s: float = 600.0) -> FastAPI:
    """The proxy's app: ``prefill_url`` / ``decode_url`` are the servers' base URLs
    (``http://host:port``), ``kv_host:kv_port`` the decode engine's KV receiver."""
    proxy = _Proxy(prefill_url, decode_url, kv_host, kv_port, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(title="pagellm prefill/decode proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.relay("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        resp = await proxy.client().get(proxy.decode_url + "/v1/models", headers=proxy.auth(request))
        return Response(resp.content, resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await proxy.healthy() else 503)

    return app


def main(args: Any) -> int:
    import uvicorn

    host, _, port = args.decode_kv.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--decode-kv must be HOST:PORT (the decode engine's KV receiver), got {args.decode_kv!r}")
    app = build_proxy_app(args.prefill, args.decode, host, int(port))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
