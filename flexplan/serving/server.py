"""The HTTP front: an OpenAI-compatible FastAPI app over an :class:`EngineLoop`, and its uvicorn
runner. It translates requests (``openai_protocol``) and never schedules: every request goes to
the engine, which decides what runs when.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's chat template), both
with ``stream: true`` as server-sent events ending ``data: [DONE]``; ``/v1/models``, ``/health``,
``/metrics`` (Prometheus). Bad input is a 4xx with OpenAI's error body; a client that leaves
aborts its request; SIGTERM drains (no new request, those in flight get ``drain_s`` seconds) and
exits 0.

The engine is any object with ``add_request``, ``abort``, ``step``, ``has_unfinished``,
``stats`` and ``tokenizer`` / ``max_model_len`` attributes (:class:`flexplan.serving.engine.Engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from jinja2 import TemplateError

from flexplan.errors import FlexplanError
from flexplan.serving import openai_protocol as oa
from flexplan.serving.loop import (
    EngineFailure,
    EngineLoop,
    QueueFullError,
    ServerShuttingDown,
)
from flexplan.serving.metrics import ServingMetrics
from flexplan.serving.openai_protocol import ApiError
from flexplan.serving.types import FINISH_ABORT, RequestOutput

log = logging.getLogger("flexplan.serve")

DRAIN_S = 5.0  # SIGTERM: seconds the requests in flight get to finish before they are aborted


def _error_response(e: ApiError, metrics: ServingMetrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.observe_error(e.status)
    return JSONResponse(e.body(), status_code=e.status)


def _engine_error(e: BaseException) -> ApiError:
    """What the loop handed a handler instead of outputs, as an HTTP error."""
    if isinstance(e, QueueFullError):
        return ApiError(429, str(e), type="rate_limit_error", code="queue_full")
    if isinstance(e, ServerShuttingDown):
        return ApiError(503, str(e), type="service_unavailable", code="shutting_down")
    if isinstance(e, EngineFailure):
        return ApiError(500, str(e), type="server_error", code="engine_failure")
    msg = str(e)  # the engine's refusal of this request's input (InvalidInputError)
    if "context" in msg and "prompt" in msg and "max_tokens" not in msg:
        return ApiError(400, msg, param="prompt", code="context_length_exceeded")
    param = "max_tokens" if "max_tokens" in msg else "prompt" if "vocabulary" in msg or "prompt" in msg else None
    return ApiError(400, msg, param=param, code="invalid_value")


class _Served:
    """The app's state: the loop, the model's names, its tokenizer and context."""

    def __init__(self, engine, model_name: str, aliases, max_waiting: int):
        self.engine, self.model_name = engine, model_name
        self.names = {model_name, *aliases}
        self.metrics = ServingMetrics(model_name)
        self.loop = EngineLoop(engine, max_waiting=max_waiting, metrics=self.metrics)
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_model_len = getattr(engine, "max_model_len", None)

    def check_model(self, model: str) -> None:
        if model and model not in self.names:  # left out: the one model served
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                           f"{', '.join(sorted(self.names))}", param="model", code="model_not_found")

    def tokens(self, p: oa.Parsed, chat: bool) -> list[int] | str:
        """The prompt as token ids (the chat template applied), its length checked against the context."""
        if chat:
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise oa.bad("this model has no chat template: use /v1/completions", "messages", "unsupported")
            try:
                text = self.tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
            except (TemplateError, ValueError, TypeError, KeyError) as e:  # the template's refusal (roles out of order)
                raise oa.bad(f"the chat template refused these messages: {e}", "messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(p.prompt, str) and self.tokenizer is not None:
            ids = self.tokenizer.encode(p.prompt)
        else:
            ids = p.prompt
        ctx, param = self.max_model_len, "messages" if chat else "prompt"
        if ctx and isinstance(ids, list):
            if len(ids) >= ctx:
                raise oa.bad(f"this model's maximum context length is {ctx} tokens; the prompt has {len(ids)} "
                             f"tokens (at most {ctx - 1})", param, "context_length_exceeded")
            if p.params.max_tokens > ctx - len(ids) and p.max_tokens_given:
                raise oa.bad(f"max_tokens={p.params.max_tokens} with a {len(ids)}-token prompt exceeds this "
                             f"model's context of {ctx} tokens: ask for at most {ctx - len(ids)}", "max_tokens")
        return ids



async def _outputs(served: _Served, rid: str, q: asyncio.Queue):
    """The request's outputs up to its finished one; an exception from the loop raised as ApiError."""
    while True:
        item = await q.get()
        if isinstance(item, BaseException):
            raise _engine_error(item)
        yield item
        if item.finished:
            return


async def _until_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine, model_name: str, *, aliases=(), max_waiting: int = 256, drain_s: float = DRAIN_S) -> FastAPI:
    """The app; its lifespan starts the engine loop and stops it (aborting what is left)."""
    served = _Served(engine, model_name, aliases, max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.loop.start()
        yield
        served.loop.stop()

    app = FastAPI(title="flexplan serve", lifespan=lifespan)
    app.state.served = served
    app.state.drain_s = drain_s

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, e: StarletteHTTPException):
        """A path or method the server has not (404, 405): OpenAI's error body, saying what it serves."""
        what = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return _error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {what}; this server "
                                        "answers POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
                                        "GET /health and GET /metrics", code=None), served.metrics)

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            return _error_response(oa.bad(f"the body is not valid JSON: {e}", None, "invalid_json"), served.metrics)
        try:
            p = oa.parse(body, chat)
            served.check_model(p.model)
            ids = served.tokens(p, chat)
            if chat and not p.max_tokens_given and served.max_model_len and isinstance(ids, list):
                p = dataclasses.replace(p, params=_with_max_tokens(p.params, served.max_model_len - len(ids)))
            rid = oa.new_id(chat)
            q = served.loop.submit(rid, ids, p.params)
        except ApiError as e:
            return _error_response(e, served.metrics)
        except (QueueFullError, ServerShuttingDown) as e:
            return _error_response(_engine_error(e), served.metrics)
        name = p.model or served.model_name
        if p.stream:
            return await _stream(served, request, rid, q, name, chat, p.include_usage)
        return await _complete(served, request, rid, q, name, chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        names = [served.model_name] + sorted(served.names - {served.model_name})
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "flexplan"}
                                           for n in names]}

    @app.get("/health")
    async def health():
        if served.loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = served.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _with_max_tokens(params, n: int):
    """Chat without max_tokens: the context left, as OpenAI does."""
    return dataclasses.replace(params, max_tokens=max(1, n))


def _ended_early(served: _Served, rid: str, e: Exception) -> Response:
    """The answer to a request that ended before its answer began: its refusal, or 499 where its
    client left (the request aborted, its KV freed)."""
    if isinstance(e, _Disconnected):
        served.loop.abort(rid)
        return Response(status_code=499)
    return _error_response(e, served.metrics)


async def _complete(served: _Served, request: Request, rid: str, q: asyncio.Queue, model: str, chat: bool):
    """A non-streaming answer; the request is aborted if its client leaves first."""
    text, last = [], None
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        async for out in _race(_outputs(served, rid, q), watcher):
            text.append(out.new_text)
            last = out
    except (ApiError, _Disconnected) as e:
        return _ended_early(served, rid, e)
    finally:
        watcher.cancel()
    if last.finish_reason == FINISH_ABORT:
        return _error_response(_engine_error(ServerShuttingDown("the request was aborted")), served.metrics)
    use = oa.usage(last.prompt_tokens, last.completion_tokens)
    make = oa.chat_completion if chat else oa.completion
    return JSONResponse(make(rid, model, oa.now_s(), "".join(text), last.finish_reason, use))


class _Disconnected(Exception):
    pass


async def _next_or_disconnect(outputs, watcher: asyncio.Future):
    """``outputs``' next item, or :class:`_Disconnected` as soon as ``watcher`` completes."""
    nxt = asyncio.ensure_future(outputs.__anext__())
    done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if nxt not in done:
        nxt.cancel()
        raise _Disconnected()
    return nxt.result()


async def _race(outputs, watcher: asyncio.Future):
    """``outputs``' items up to the finished one, or :class:`_Disconnected` once ``watcher`` completes."""
    while True:
        out = await _next_or_disconnect(outputs, watcher)
        yield out
        if out.finished:
            return


async def _stream(served: _Served, request: Request, rid: str, q: asyncio.Queue, model: str, chat: bool,
                  include_usage: bool):
    """Server-sent events in OpenAI's chunk format. The first output is awaited before the 200 is
    sent, so an engine refusal (e.g. a prompt too long) is still an HTTP error."""
    outputs = _outputs(served, rid, q)
    watcher = asyncio.ensure_future(_until_disconnect(request))  # a client may leave while it queues
    try:
        first = await _next_or_disconnect(outputs, watcher)
    except (ApiError, _Disconnected) as e:
        return _ended_early(served, rid, e)
    finally:
        watcher.cancel()
    created = oa.now_s()

    def event(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def events():
        last: RequestOutput | None = None
        done = False
        try:
            if chat:  # OpenAI's first chat chunk names the role
                yield event(oa.chunk(rid, model, created, chat, "", None, first=True))
            out = first
            while True:
                last = out
                if out.finish_reason == FINISH_ABORT:
                    raise _engine_error(ServerShuttingDown("the request was aborted"))
                if out.new_text:
                    yield event(oa.chunk(rid, model, created, chat, out.new_text, None))
                if out.finished:
                    break
                out = await outputs.__anext__()
            yield event(oa.chunk(rid, model, created, chat, None, last.finish_reason))
            if include_usage:
                yield event(oa.usage_chunk(rid, model, created, chat,
                                           oa.usage(last.prompt_tokens, last.completion_tokens)))
            done = True
        except ApiError as e:  # after the 200: OpenAI's stream error event (the client raises it)
            served.metrics.observe_error(e.status)
            yield event(e.body())
            done = True
        finally:
            if not done:  # the client left (the generator closed or cancelled): free its KV
                served.loop.abort(rid)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class ServerFailed(FlexplanError):
    """The HTTP server stopped on its own (it could not start, or failed) while the engine ran."""


class _DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM or SIGINT, first tells the engine loop to drain, and exits 0 once
    done (uvicorn would re-raise the signal: the drain is the handling it asked for)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig, frame) -> None:
        self._app.state.served.loop.begin_drain(self._app.state.drain_s)
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            self._captured_signals.clear()


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` until SIGTERM / SIGINT; in-flight requests get ``drain_s`` seconds.

    The engine steps on this (the calling, main) thread, the one that loaded the model, and uvicorn
    runs on another: :mod:`flexplan.compute_thread`'s rule (one thread runs every OpenMP region).
    The HTTP thread runs no torch. Signals reach the main thread, which hands them to uvicorn (it
    listens for them only when it runs on the main thread itself)."""
    drain_s = app.state.drain_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_s + 2,
                            access_log=False)
    http = _DrainingServer(config, app)
    loop = app.state.served.loop
    loop.hosted = True
    thread = threading.Thread(target=http.run, name="flexplan-http", daemon=True)
    handlers = {sig: signal.signal(sig, http.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread.start()
        stopped = loop.run_here(thread.is_alive)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    thread.join(drain_s + 5)
    if not http.started or not (stopped or http.should_exit):  # never bound its port, or stopped unasked
        raise ServerFailed(f"the HTTP server on {host}:{port} stopped before the engine (its log above says why: "
                           "e.g. the port is in use; give another with --port)")
