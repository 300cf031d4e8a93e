"""Routes: /v1/completions, /v1/chat/completions (both streamed as server-sent events with
`stream: true`), /v1/models, /health and /metrics (Prometheus). Every error is answered
with an OpenAI-style body; a full queue is 429; with an API key, /v1 needs the bearer token.
Requests are checked by the engine's own code (SamplingParams, the prompt checks), so the
server accepts exactly what the offline API accepts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from vegas_spec.config import ConfigError
from vegas_spec.engine import LLMEngine, RequestOutput
from vegas_spec.sequence import Sequence
from vegas_spec.serve.async_engine import AsyncEngine, QueueFull
from vegas_spec.serve.metrics import Metrics
from vegas_spec.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    new_id,
    usage,
    usage_chunk,
)
from vegas_spec.tokenizer import encode_chat

DISCONNECT_POLL_S = 0.25
OPEN_PATHS = ("/health", "/metrics")
MAX_BODY_BYTES = 32 << 20  # a request body past this is 413 before it is read (or as it is)
BODY_TIMEOUT_S = 30.0  # a body that stops arriving for this long is 408 (a slow client)
HEADER_TIMEOUT_S = 10.0  # a connection whose request line and headers take longer is 408
RETRY_AFTER_S = 1  # a refused request's Retry-After: the queue moves every step
WARNING_HEADER = "X-Vegas-Warning"  # what the server changed in a request (max_tokens capped)
_log = logging.getLogger("uvicorn.error")  # uvicorn's own log: its handlers, its format


class Server:
    """The state one app serves from: the engine thread, the model's name, the metrics."""

    def __init__(self, engine: LLMEngine, model_name: str, max_queue: int,
                 api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
                 body_timeout: float = BODY_TIMEOUT_S) -> None:
        self.metrics = Metrics()
        self.metrics.gauges(engine)
        self.engine = AsyncEngine(engine, max_queue, self.metrics.step, self.metrics.abort)
        self.model_name, self.api_key, self.max_body = model_name, api_key, max_body
        self.body_timeout = body_timeout

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"`{self.model_name}`", "invalid_request_error", "model",
                           "model_not_found")

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise _key_error()


class Gate:
    """ASGI middleware in front of every route: without the key (where the server has one) a
    request is answered 401 from its headers alone, its body never read; a body longer than
    max_body (by Content-Length, or as it arrives) is answered 413, one that stops arriving
    for body_timeout seconds 408."""

    def __init__(self, app: Any, api_key: str | None, max_body: int,
                 body_timeout: float = BODY_TIMEOUT_S) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.body_timeout = body_timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", b"")
            if not secrets.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await _send(send, _key_error())
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send(send, _too_large(self.max_body))
        seen, whole = 0, False

        async def limited() -> dict:  # a body without a length: counted as it arrives
            nonlocal seen, whole
            if whole:  # after the body: a streaming response waits here for a disconnect
                return await receive()
            try:  # a client that stops sending (or sends less than its length) times out
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                raise HTTPException(408, f"The request body stopped arriving for "
                                         f"{self.body_timeout:g} s") from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise HTTPException(413, _too_large(self.max_body).message)
            return message

        await self.app(scope, limited, send)


def _key_error() -> APIError:
    return APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    "authentication_error", None, "invalid_api_key")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server takes ({limit} bytes)",
                    code="body_too_large")


async def _send(send: Callable, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _server(request: Request) -> Server:
    return request.app.state.server


def _check_key(request: Request) -> None:
    _server(request).check_key(request)


def build_app(server: Server) -> FastAPI:
    """The app serving `server`. Its routes read the server from the app's state, never from
    a closure: FastAPI keeps route callables in process-wide caches, and a route that held
    the server would keep its engine (KV pool, model) alive after the app is gone."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.server.engine.shutdown()

    # With a key, only /health and /metrics answer without it (probes and scrapers); the
    # API's documentation and schema are off: they describe what the key guards.
    keyed = server.api_key is not None
    app = FastAPI(title="vegas-spec", lifespan=lifespan,
                  **({"docs_url": None, "redoc_url": None, "openapi_url": None} if keyed else {}))
    app.state.server = server
    _errors(app)
    # Checked by the gate before the body is read; the dependency keeps each route's own check.
    app.add_middleware(Gate, api_key=server.api_key, max_body=server.max_body,
                       body_timeout=server.body_timeout)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_key)])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = _server(request).metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": _server(request).model_name,
                                            "object": "model", "created": 0,
                                            "owned_by": "vegas-spec"}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server = _server(request)
        server.check_model(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        params = _params(body)
        build = lambda e: e.sequence(prompt, params)  # noqa: E731
        return await _serve(server, request, build, body, False)

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        server = _server(request)
        server.check_model(body.model)
        body.check_supported()
        params = _params(body)
        messages = [m.template_message() for m in body.messages]
        build = lambda e: e.sequence(encode_chat(e.tokenizer, messages), params)  # noqa: E731
        return await _serve(server, request, build, body, True)

    app.include_router(v1)
    return app


def _params(body: CompletionRequest | ChatRequest) -> Any:
    try:
        return body.sampling(default_max=16 if isinstance(body, CompletionRequest) else 256)
    except ConfigError as e:
        raise APIError(400, str(e)) from None


def _capped(seq: Sequence, context: int) -> str | None:
    """Why seq will stop before its max_tokens (None: it may reach them)."""
    room = seq.limit - len(seq.prompt_ids)
    if seq.params.max_tokens <= room:
        return None
    return (f"max_tokens {seq.params.max_tokens} capped to {room}: the prompt's "
            f"{len(seq.prompt_ids)} tokens leave no more room in the model's {context}-token "
            "context (finish_reason \"length\" there)")


async def _serve(server: Server, request: Request, build: Callable[[LLMEngine], Sequence],
                 body: CompletionRequest | ChatRequest, chat: bool) -> Response:
    """Queue the request; its first output (or its error) arrives before the response
    starts, so that a refused request gets its status code. A max_tokens that the context
    caps is said in a warning header and a log line."""
    notes: list[str] = []

    def checked(engine: LLMEngine) -> Sequence:
        seq = build(engine)
        note = _capped(seq, engine.max_model_len)
        if note is not None:
            notes.append(note)
        return seq

    outputs = server.engine.generate(checked)
    try:  # queued until a row is free: a client that leaves meanwhile gives its place up
        first = await _next(outputs, request)
    except QueueFull as e:
        raise APIError(429, str(e), "rate_limit_exceeded", None, "queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ConfigError as e:  # the prompt checks (PromptError too)
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    if first is None:  # the client went away
        return Response(status_code=499)
    rid = new_id("chatcmpl" if chat else "cmpl")
    headers = {}
    if notes:
        _log.warning("%s: %s", rid, notes[0])
        headers[WARNING_HEADER] = notes[0]
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _events(server, outputs, first, rid, chat, with_usage)
        return _Stream(events, media_type="text/event-stream", headers=headers)
    last = await _last(outputs, first, request)
    if last is None:  # the client went away
        return Response(status_code=499)
    return JSONResponse(_final(server, last, rid, chat), headers=headers)


class _Stream(StreamingResponse):
    """A stream whose events are closed however it ends: when its client disconnects,
    starlette cancels the sending and leaves the event generator suspended for the garbage
    collector, so without this the request would decode on, unread and uncounted, until it
    finished or the generator happened to be collected."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _next(outputs: AsyncIterator[RequestOutput],
                request: Request) -> RequestOutput | None:
    """The request's next output (its errors raised), or None once the client disconnects:
    the request is then aborted, queued or running."""
    nxt = asyncio.ensure_future(anext(outputs))
    while not nxt.done():
        await asyncio.wait([nxt], timeout=DISCONNECT_POLL_S)
        if not nxt.done() and await request.is_disconnected():
            nxt.cancel()  # the generator's own clean-up aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await nxt
            return None
    return nxt.result()


async def _last(outputs: AsyncIterator[RequestOutput], out: RequestOutput,
                request: Request) -> RequestOutput | None:
    """The final output, or None once the client disconnects (the request is aborted)."""
    while not out.finished:
        nxt = await _next(outputs, request)
        if nxt is None:
            return None
        out = nxt
    return out


def _final(server: Server, out: RequestOutput, rid: str, chat: bool) -> dict[str, Any]:
    use = usage(len(out.prompt_token_ids), len(out.token_ids))
    if chat:
        return chat_body(rid, server.model_name, out.text, out.finish_reason, use)
    return completion_body(rid, server.model_name, out.text, out.finish_reason, use)


async def _events(server: Server, outputs: AsyncIterator[RequestOutput], out: RequestOutput,
                  rid: str, chat: bool, with_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per step's text delta, the finish reason in the last,
    the usage in one more chunk when asked for, then [DONE]. Cancelled when the client
    disconnects: the generator's close aborts."""
    model = server.model_name
    try:
        if chat:
            yield _sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
        while True:
            finish = out.finish_reason
            if out.delta_text or finish:
                delta = {"content": out.delta_text} if out.delta_text or not chat else {}
                yield _sse(chat_chunk(rid, model, delta, finish) if chat else
                           completion_body(rid, model, out.delta_text, finish, chunk=True))
            if out.finished:
                break
            out = await anext(outputs)
        if with_usage:
            use = usage(len(out.prompt_token_ids), len(out.token_ids))
            yield _sse(usage_chunk(rid, model, chat, use))
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _error(APIError(400, "The body is not valid JSON"))
        field = loc[0] if loc else None  # the request's field, as OpenAI names `param`
        message = first.get("msg", "invalid request")
        if field is not None:
            # a field of several accepted forms (a prompt: text, ids, ...) fails each of them
            forms = sum(1 for err in errors if tuple(err.get("loc", ()))[1:2] == (field,))
            message = f"{field}: {message}" + (
                f" (the value fits none of the field's {forms} accepted forms)"
                if forms > 1 else "")
        return _error(APIError(400, message, param=field))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))


_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
              b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def http_protocol(header_timeout: float = HEADER_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with a header timeout: a connection that has not sent a
    whole request line and headers `header_timeout` seconds after it opened (or after its
    last response, kept alive) is answered 408 and closed, so that slow or silent clients
    cannot hold connections open (uvicorn times only the idle keep-alive wait, and that
    timer stops at the first byte)."""

    class TimedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # the next request on this connection: timed again

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            body = json.dumps(APIError(408, f"no whole request line and headers within "
                                       f"{header_timeout:g} s").body()).encode()
            self.transport.write(_TIMED_OUT % (len(body), body))
            self.transport.close()

    return TimedH11Protocol


def serve(engine: LLMEngine, model_name: str, host: str, port: int, max_queue: int,
          api_key: str | None = None, shutdown_timeout: float = 5.0) -> str:
    """Run the server until a signal (SIGINT, SIGTERM) -> how it ended, one line. The first
    signal stops accepting requests and gives those in flight `shutdown_timeout` seconds to
    finish, then ends each with finish reason "abort"; a second signal ends them at once.
    Either way the engine thread stops before this returns."""
    server = Server(engine, model_name, max_queue, api_key)
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="info",
                            http=http_protocol(), timeout_graceful_shutdown=shutdown_timeout + 2.0)
    runner = _Graceful(config, server, shutdown_timeout)
    runner.run()
    server.engine.shutdown()  # also when forced: no step runs on past the interpreter's exit
    if runner.signals:
        return (f"shut down after {runner.signals[0]} ({runner.aborted} request(s) aborted"
                f"{', at a second signal' if len(runner.signals) > 1 else ''})")
    return "shut down"


class _Graceful(uvicorn.Server):
    """uvicorn's server with a bounded grace period and a second signal that ends every
    request at once (a third stops waiting even for their connections); signals are not
    raised again after the shutdown, so the exit code is one."""

    def __init__(self, config: Any, server: Server, grace: float) -> None:
        super().__init__(config)
        self.server, self.grace = server, grace
        self.signals: list[str] = []
        self.timer: threading.Timer | None = None

    @property
    def aborted(self) -> int:
        return self.server.engine.ended

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.signals.append(signal.Signals(sig).name)
        if len(self.signals) > 2:  # a third: uvicorn stops waiting for anything
            self.force_exit = True
            return
        if self.should_exit:  # a second signal: every request ends now, then the shutdown
            self.server.engine.end_all()
            return
        self.should_exit = True
        self.timer = threading.Timer(self.grace, self.server.engine.end_all)
        self.timer.daemon = True
        self.timer.start()
