"""The FastAPI application: OpenAI-compatible routes, /health, /metrics, /stats, and the browser UI at /.

Invariants:
- Handlers run on the event loop thread and never touch the engine: they validate and tokenize
  (on worker threads, see limits.py: the loop never waits on a big body) then go through
  AsyncEngine (queues). The engine exists only once the loader finished.
- Every request passes gate.py first (Host, Origin, API key, content type) and BodyLimit (size).
- Anything a client sends that is wrong ends as an ApiError -> OpenAI error object
  (400/401/403/404/405/413/415/429/503), unknown routes and methods included; an unexpected exception in a
  handler becomes a 500 error object, and the server keeps serving.
- A request whose client goes away (stream closed or socket gone) is aborted in the engine,
  which frees its KV blocks.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .async_engine import AsyncEngine
from .constraints import request_grammar
from .errors import ApiError, from_validation_error
from .field_limits import check_fields
from .gate import Access, Gate
from .generation import Job, Runner
from .limits import BodyLimit, ConcurrencyLimit, Lease, Limits, parse_body
from .loader import ModelLoader
from .metrics import ServerMetrics
from .openai_format import Shape
from .prompts import chat_ids, completion_ids
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
)
from .tool_calls import format_for

STATIC_DIR = Path(__file__).with_name("static")  # index.html, app.js, style.css of the browser UI
log = logging.getLogger("expertcache.server")


@dataclass
class ServerConfig:
    model_name: str
    llm_kwargs: dict
    api_key: str | None = None
    log_interval: float = 10.0
    aliases: set[str] = field(default_factory=set)  # other names accepted in 'model'
    on_load_error: Callable[[str], None] | None = None  # e.g. make uvicorn exit
    save_expert_stats: str | None = None  # written at shutdown, after the engine thread stopped
    limits: Limits = field(default_factory=Limits)  # body size, sequences in flight per key, field limits
    access: Access | None = None  # Host names, public routes, API docs (None: loopback, nothing public)

    def __post_init__(self):
        if self.access is None:
            self.access = Access(api_key=self.api_key)
        elif self.api_key is not None and self.access.api_key is None:
            self.access.api_key = self.api_key


class ServerState:
    """Loader, engine (None until loaded) and metrics of one app."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.metrics = ServerMetrics()
        self.engine: AsyncEngine | None = None
        self.loader = ModelLoader(cfg.llm_kwargs, on_done=self._loaded)
        self.metrics.attach(
            lambda: self.engine.snapshot() if self.engine else {}, lambda: self.loader.progress
        )
        self.started = int(time.time())
        self.in_flight = ConcurrencyLimit(cfg.limits.max_concurrent_per_key)

    def _loaded(self, llm, error: str | None) -> None:  # loader thread
        if llm is not None:
            if llm.engine.recorder is not None:  # serve --record-routing: a bounded trace
                llm.engine.record_max_steps = self.cfg.limits.record_routing_max_steps
            engine = AsyncEngine(llm, self.metrics, self.cfg.log_interval)
            engine.start()
            self.engine = engine
        elif self.cfg.on_load_error:
            self.cfg.on_load_error(error or "unknown error")

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            if self.loader.state == "error":
                raise ApiError(
                    f"the model failed to load: {self.loader.error}", status=503, type="server_error"
                )
            raise ApiError(
                f"the model is still loading ({self.loader.progress:.0%}); retry when /health says ok",
                status=503,
                type="server_error",
                code="model_loading",
            )
        return self.engine

    @staticmethod
    def who(request: Request) -> str:
        """The caller's identity (its API key, else its address), as gate.py found it."""
        return request.scope["expertcache.who"]

    def body_limit(self) -> int:
        return self.cfg.limits.body_limit(self.engine.llm.max_model_len if self.engine else None)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name and name not in self.cfg.aliases:
            raise ApiError(
                f"model {name!r} does not exist; this server serves {self.cfg.model_name!r}",
                "model",
                code="model_not_found",
            )

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


def _completion_job(llm, req: CompletionRequest, shape: Shape) -> Job:
    prompts = req.prompts()
    if not prompts:
        raise ApiError("'prompt' is an empty list", "prompt")
    ids = [completion_ids(llm, p) for p in prompts]
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    params = sampling_params(
        req, len(ids[longest]), llm.max_model_len, "prompt", request_grammar(llm, req, None, None)
    )
    texts = []
    if req.echo:
        texts = [
            p if isinstance(p, str) else (llm.tokenizer.decode(i) if llm.tokenizer else "")
            for p, i in zip(prompts, ids)
        ]
    return Job(shape, ids, params, req.samples, bool(req.stream), bool(req.echo), texts)


def _chat_job(llm, req: ChatCompletionRequest, shape: Shape) -> Job:
    tok = llm.tokenizer
    template = tok.chat_template if tok is not None else None
    fmt = format_for(template)
    tools = [t.function.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if tools and (fmt is None or "tools" not in template):
        raise ApiError(
            "this model's chat template has no tool-call format, so 'tools' cannot be honoured", "tools"
        )
    if req.tool_choice not in (None, "none", "auto") and not tools:
        raise ApiError("'tool_choice' forces a tool call but 'tools' is empty", "tool_choice")
    tools_on = bool(tools) and req.tool_choice != "none"
    kwargs = {"tools": tools} if tools_on else {}
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    ids = chat_ids(llm, req.messages, req.add_generation_prompt, **kwargs)
    grammar = request_grammar(llm, req, tools if tools_on else None, fmt)
    params = sampling_params(req, len(ids), llm.max_model_len, "messages", grammar)
    return Job(
        shape,
        [ids],
        params,
        req.samples,
        bool(req.stream),
        tool_format=fmt,
        tools_on=tools_on,
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


async def _respond(state: ServerState, request: Request, job: Job):
    engine = state.ready()
    if job.params.stop and engine.llm.tokenizer is None:
        raise ApiError("'stop' strings need the model's tokenizer.json", "stop")
    runner = Runner(engine, job)
    await runner.start()
    if job.stream:
        return runner.stream()
    return await runner.collect(request)


async def _limited(state: ServerState, request: Request, run):
    """run(lease) -> its response, counted against the caller's sequences in flight (one until
    run grows the lease to the request's prompts x samples) until the response (a stream: its last
    chunk, or the client going away) is done."""
    lease = Lease(state.in_flight, state.who(request))
    try:
        response = await run(lease)
    except BaseException:
        lease.release()
        raise
    if not isinstance(response, StreamingResponse):
        lease.release()
        return response
    body = response.body_iterator

    async def counted():
        try:
            async for chunk in body:
                yield chunk
        finally:
            lease.release()

    response.body_iterator = counted()
    return response


def create_app(cfg: ServerConfig) -> FastAPI:
    """The app: the routes of `router` over one ServerState (app.state.server), the gate and the body
    limit in front, every error as an OpenAI error object."""
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loader.start()
        yield
        state.close()

    docs = cfg.access.api_docs  # /docs, /redoc, /openapi.json only when asked for (then behind the key)
    app = FastAPI(
        title="expertcache",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server = state
    app.add_middleware(BodyLimit, limit=state.body_limit)
    app.add_middleware(Gate, access=cfg.access)  # added last: runs first, before any body byte is read
    for kind, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(kind, handler)
    # the browser UI: static files of this package, talking to the endpoints below
    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")
    app.include_router(router)
    return app


def _server(request: Request) -> ServerState:
    return request.app.state.server


# -- errors: every one an OpenAI error object ---------------------------------------------------------


async def _api_error(request: Request, e: ApiError):
    return e.response()


async def _http_error(request: Request, e: StarletteHTTPException):  # unknown route, wrong method
    codes = {404: "not_found", 405: "method_not_allowed"}
    err = ApiError(
        f"{request.method} {request.url.path}: {e.detail}",
        status=e.status_code,
        code=codes.get(e.status_code),
    )
    response = err.response()
    response.headers.update(e.headers or {})  # 405's Allow
    return response


async def _invalid(request: Request, e: RequestValidationError):  # a route's declared parameters
    return from_validation_error(e).response()


async def _gone(request: Request, e: ClientDisconnect):  # the client left while sending its body
    log.info("%s %s: the client disconnected before its body was complete", request.method, request.url.path)
    return Response(status_code=499)


async def _unexpected(request: Request, e: Exception):
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return ApiError(f"internal error: {type(e).__name__}", status=500, type="server_error").response()


ERROR_HANDLERS = {
    ApiError: _api_error,
    StarletteHTTPException: _http_error,
    RequestValidationError: _invalid,
    ClientDisconnect: _gone,
    Exception: _unexpected,
}

# -- routes ---------------------------------------------------------------------------------------------

router = APIRouter()


@router.get("/", include_in_schema=False)
async def ui():
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/health")
async def health(request: Request):
    """Public: the status (ok, loading with its progress, error) and nothing else (the load error's
    text, which names files, goes to the server's log)."""
    state = _server(request)
    if state.engine is not None:
        return {"status": "ok"}
    if state.loader.state == "error":
        return JSONResponse({"status": "error"}, status_code=503)
    return JSONResponse({"status": "loading", "progress": round(state.loader.progress, 4)}, status_code=503)


@router.get("/v1/models")
async def models(request: Request):
    state = _server(request)
    card = {
        "id": state.cfg.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "expertcache",
    }
    if state.engine is not None:
        card["max_model_len"] = state.engine.llm.max_model_len
    return {"object": "list", "data": [card]}


@router.get("/v1/models/{model_id:path}")
async def model_card(model_id: str, request: Request):
    cfg = _server(request).cfg
    if model_id != cfg.model_name and model_id not in cfg.aliases:
        raise ApiError(
            f"model {model_id!r} does not exist; this server serves {cfg.model_name!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    return (await models(request))["data"][0]


async def _generate(request: Request, chat: bool):
    state = _server(request)
    cfg = state.cfg

    async def run(lease: Lease):
        req = await _parse(request, ChatCompletionRequest if chat else CompletionRequest)
        state.check_model(req.model)
        llm = state.ready().llm
        count, param = check_fields(req, cfg.limits, llm.engine.scheduler.max_num_seqs)
        lease.grow(count, param)  # prompts x samples against --max-concurrent-per-key
        shape = Shape(
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            cfg.model_name,
            chat=chat,
            include_usage=req.include_usage,
        )
        # tokenizing (GIL released) and grammar compiling on a worker thread: the loop stays free
        job = await run_in_threadpool(_chat_job if chat else _completion_job, llm, req, shape)
        return await _respond(state, request, job)

    return await _limited(state, request, run)


@router.post("/v1/completions")
async def completions(request: Request):
    return await _generate(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _generate(request, chat=True)


@router.post("/tokenize")
async def tokenize(request: Request):
    state = _server(request)
    req = await _parse(request, TokenizeRequest)
    state.check_model(req.model)
    llm = state.ready().llm
    if req.prompt is not None:
        if llm.tokenizer is None:
            raise ApiError("this model has no tokenizer.json", "prompt")
        ids = await run_in_threadpool(llm.tokenizer.encode, req.prompt, req.add_special_tokens is not False)
    else:
        ids = await run_in_threadpool(chat_ids, llm, req.messages, req.add_generation_prompt)
    strs = None
    if req.return_token_strs:
        strs = await run_in_threadpool(lambda: [llm.tokenizer.tok.id_to_token(i) for i in ids])
    return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request):
    state = _server(request)
    req = await _parse(request, DetokenizeRequest)
    state.check_model(req.model)
    llm = state.ready().llm
    if llm.tokenizer is None:
        raise ApiError("this model has no tokenizer.json", "tokens")
    vocab = llm.cfg.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": await run_in_threadpool(llm.tokenizer.decode, req.tokens)}


@router.get("/metrics")
async def metrics(request: Request):
    body = _server(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/stats")
async def stats(request: Request):
    state = _server(request)
    snap = dict(state.engine.snapshot()) if state.engine else {}
    experts = snap.pop("expert_stats", {})
    return {
        "model": state.cfg.model_name,
        "status": "ok" if state.engine else state.loader.state,
        "engine": snap,
        "expert_stats": experts,
    }
