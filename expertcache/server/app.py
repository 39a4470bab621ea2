"""The FastAPI application: OpenAI-compatible routes, /health, /metrics, /stats.

Invariants:
- Handlers run on the event loop thread and never touch the engine: they tokenize, validate,
  then go through AsyncEngine (queues). The engine exists only once the loader finished.
- Anything a client sends that is wrong ends as an ApiError -> OpenAI error object (400/401/503);
  an unexpected exception in a handler becomes a 500 error object, and the server keeps serving.
- A request whose client goes away (stream closed or socket gone) is aborted in the engine,
  which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import ValidationError

from .async_engine import AsyncEngine, Delta, Final, RequestHandle
from .errors import ApiError, from_validation_error
from .limits import BodyLimit, ConcurrencyLimit, Limits, parse_body
from .loader import ModelLoader
from .metrics import ServerMetrics
from .openai_format import DONE, Shape, error_event
from .prompts import chat_ids, completion_ids
from .protocol import ChatCompletionRequest, CompletionRequest, sampling_params

log = logging.getLogger("expertcache.server")
DISCONNECT_POLL_S = 1.0


@dataclass
class ServerConfig:
    model_name: str
    llm_kwargs: dict
    api_key: str | None = None
    log_interval: float = 10.0
    aliases: set[str] = field(default_factory=set)  # other names accepted in 'model'
    on_load_error: Callable[[str], None] | None = None  # e.g. make uvicorn exit
    save_expert_stats: str | None = None  # written at shutdown, after the engine thread stopped
    limits: Limits = field(default_factory=Limits)  # body size, requests in flight per key


class ServerState:
    """Loader, engine (None until loaded) and metrics of one app."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.metrics = ServerMetrics()
        self.engine: AsyncEngine | None = None
        self.loader = ModelLoader(cfg.llm_kwargs, on_done=self._loaded)
        self.metrics.attach(lambda: self.engine.snapshot() if self.engine else {}, lambda: self.loader.progress)
        self.started = int(time.time())
        self.in_flight = ConcurrencyLimit(cfg.limits.max_concurrent_per_key)

    def _loaded(self, llm, error: str | None) -> None:  # loader thread
        if llm is not None:
            engine = AsyncEngine(llm, self.metrics, self.cfg.log_interval)
            engine.start()
            self.engine = engine
        elif self.cfg.on_load_error:
            self.cfg.on_load_error(error or "unknown error")

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            if self.loader.state == "error":
                raise ApiError(f"the model failed to load: {self.loader.error}", status=503, type="server_error")
            raise ApiError(f"the model is still loading ({self.loader.progress:.0%}); retry when /health says ok",
                           status=503, type="server_error", code="model_loading")
        return self.engine

    def check_auth(self, request: Request) -> str:
        """-> who is asking: the API key given (one of several when --api-key-file lists more), or the
        client's address on a server without a key; ApiError 401 for a wrong or missing key."""
        key = self.cfg.api_key
        if not key:
            return request.client.host if request.client else "?"
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip().encode()
        # every key compared (constant time each): no early exit that times which one matched
        matches = [k for k in ((key,) if isinstance(key, str) else key) if hmac.compare_digest(token, k.encode())]
        if scheme.lower() != "bearer" or not matches:
            raise ApiError("missing or invalid API key: send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")
        return matches[0]

    def body_limit(self) -> int:
        return self.cfg.limits.body_limit(self.engine.llm.max_model_len if self.engine else None)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name and name not in self.cfg.aliases:
            raise ApiError(f"model {name!r} does not exist; this server serves {self.cfg.model_name!r}", "model",
                           code="model_not_found")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            try:
                if self.cfg.save_expert_stats:
                    self.engine.llm.experts.save_stats(self.cfg.save_expert_stats)
                    log.info("expert statistics written to %s", self.cfg.save_expert_stats)
                self.engine.llm.close()
            except Exception:  # noqa: BLE001
                log.exception("closing the model failed")


def _validate(raw: bytes, model_cls):
    obj = parse_body(raw)
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _parse(request: Request, model_cls):
    """Body -> a validated request (JSON parsing and validation on a worker thread); ApiError 4xx."""
    raw = await request.body()  # BodyLimit raises the 413 while reading
    return await run_in_threadpool(_validate, raw, model_cls)


async def _collect(engine: AsyncEngine, handle: RequestHandle, request: Request) -> tuple[str, Delta] | None:
    """All of a request's text and its last item; None (request aborted) if the client went away."""

    async def gather():
        parts = []
        async for d in handle.deltas():
            parts.append(d.text)
            if d.finish_reason is not None or d.error is not None:
                return "".join(parts), d
        raise RuntimeError("request stream ended without a final item")

    task = asyncio.ensure_future(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                log.info("request %s aborted: client disconnected", handle.request_id)
                return None
    finally:
        if not task.done():
            task.cancel()
            engine.abort(handle.request_id)


async def _stream(engine: AsyncEngine, handle: RequestHandle, shape: Shape):
    try:
        if shape.chat:
            yield shape.chunk(None, role=True)
        async for d in handle.deltas():
            if d.error is not None:
                yield error_event(d.error)
                break
            if d.finish_reason is None:
                if d.text:
                    yield shape.chunk(d.text)
                continue
            yield shape.chunk(d.text, d.finish_reason, d.final)
            if shape.include_usage:
                yield shape.usage_chunk(d.final)
        yield DONE
    finally:
        if not handle.finished:  # client disconnected mid-stream
            engine.abort(handle.request_id)
            log.info("request %s aborted: client disconnected", handle.request_id)


async def _respond(state: ServerState, request: Request, req, ids: list[int], shape: Shape, prompt_param: str):
    engine = state.ready()
    llm = engine.llm
    params = sampling_params(req, len(ids), llm.max_model_len, prompt_param)
    if params.stop and llm.tokenizer is None:
        raise ApiError("'stop' strings need the model's tokenizer.json", "stop")
    handle = await engine.add(shape.request_id, ids, params)
    if req.stream:
        return StreamingResponse(_stream(engine, handle, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    got = await _collect(engine, handle, request)
    if got is None:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    text, last = got
    if last.error is not None:
        raise ApiError(last.error, status=400 if "does not fit" in last.error else 500,
                       type="invalid_request_error" if "does not fit" in last.error else "server_error")
    final: Final = last.final
    return JSONResponse(shape.full(text, last.finish_reason, final))


async def _limited(state: ServerState, who: str, run):
    """run() -> its response, counted against `who`'s requests in flight until the response (a
    stream: its last chunk, or the client going away) is done."""
    state.in_flight.acquire(who)
    try:
        response = await run()
    except BaseException:
        state.in_flight.release(who)
        raise
    if not isinstance(response, StreamingResponse):
        state.in_flight.release(who)
        return response
    body = response.body_iterator

    async def counted():
        try:
            async for chunk in body:
                yield chunk
        finally:
            state.in_flight.release(who)

    response.body_iterator = counted()
    return response


def create_app(cfg: ServerConfig) -> FastAPI:
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loader.start()
        yield
        state.close()

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimit, limit=state.body_limit)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # unknown route, wrong method
        codes = {404: "not_found", 405: "method_not_allowed"}
        err = ApiError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code,
                       code=codes.get(e.status_code))
        response = err.response()
        response.headers.update(e.headers or {})  # 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):  # a route's declared parameters
        return from_validation_error(e).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return ApiError(f"internal error: {type(e).__name__}", status=500, type="server_error").response()

    @app.get("/health")
    async def health():
        if state.engine is not None:
            return {"status": "ok"}
        body = {"status": state.loader.state, "progress": round(state.loader.progress, 4)}
        if state.loader.error:
            body["message"] = state.loader.error
        return JSONResponse(body, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        card = {"id": cfg.model_name, "object": "model", "created": state.started, "owned_by": "expertcache"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.llm.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        async def run():
            req = await _parse(request, CompletionRequest)
            state.check_model(req.model)
            llm = state.ready().llm
            ids = await run_in_threadpool(completion_ids, llm, req.single_prompt())
            shape = Shape(f"cmpl-{uuid.uuid4().hex}", cfg.model_name, chat=False, include_usage=req.include_usage)
            return await _respond(state, request, req, ids, shape, "prompt")

        return await _limited(state, state.check_auth(request), run)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async def run():
            req = await _parse(request, ChatCompletionRequest)
            state.check_model(req.model)
            llm = state.ready().llm
            ids = await run_in_threadpool(chat_ids, llm, req.messages, req.add_generation_prompt)
            shape = Shape(f"chatcmpl-{uuid.uuid4().hex}", cfg.model_name, chat=True,
                          include_usage=req.include_usage)
            return await _respond(state, request, req, ids, shape, "messages")

        return await _limited(state, state.check_auth(request), run)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        snap = dict(state.engine.snapshot()) if state.engine else {}
        experts = snap.pop("expert_stats", {})
        return {"model": cfg.model_name, "status": "ok" if state.engine else state.loader.state,
                "engine": snap, "expert_stats": experts}

    return app
