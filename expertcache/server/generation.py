"""One OpenAI request through the engine: its prompts (a list in /v1/completions) and samples
(n, best_of) become choices, returned whole or streamed.

Invariants:
- each prompt is one engine request (id `<response id>-<prompt number>` when there are several),
  all feeding one queue; choice index = prompt number * n + sample number (OpenAI's numbering);
- with best_of > n (never streamed) the n samples of highest cumulative logprob are returned;
- when the chat format parses its output (tools given and tool_choice not 'none', or a format
  whose channels always need parsing, GPT-OSS harmony), the text is the completion decoded with
  special tokens and split into content / reasoning_content / tool_calls (server/tool_calls);
  streamed, that text is decoded a few tokens at a time (engine/stop_text.py) and parsed from the
  last settled call, on a worker thread: the event loop never parses;
- a client that goes away aborts every engine request of the job.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.params import SamplingParams
from ..engine.stop_text import StopText
from .async_engine import AsyncEngine, Delta, Final
from .errors import ApiError
from .logprobs_format import TokenText, chat_content, chat_logprobs, completion_logprobs
from .openai_format import DONE, Shape, error_event, usage
from .tool_calls import StreamDiff, ToolFormat, new_call_id

log = logging.getLogger("expertcache.server")


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away: the body is read by now, so the next ASGI message is
    http.disconnect (a client that closes its connection, or the server shutting down)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Job:
    shape: Shape
    prompts: list[list[int]]
    params: SamplingParams  # params.n = samples run per prompt (best_of when given)
    n: int  # choices returned per prompt
    stream: bool = False
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)  # for echo
    tool_format: ToolFormat | None = None  # parse the output with this format
    tools_on: bool = False  # report tool calls
    parallel_tool_calls: bool = True

    def request_id(self, i: int) -> str:
        return self.shape.request_id if len(self.prompts) == 1 else f"{self.shape.request_id}-{i}"


@dataclass
class _Choice:
    parts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    final: Final | None = None
    diff: StreamDiff | None = None
    special: StopText | None = None  # streamed: the completion decoded with special tokens, incrementally
    special_text: str = ""

    def add(self, d: Delta) -> None:
        self.parts.append(d.text)
        self.ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.final = d.finish_reason, d.final


class Runner:
    """Adds a Job's prompts to the engine and turns the engine's items into the response."""

    def __init__(self, engine: AsyncEngine, job: Job):
        self.engine, self.job = engine, job
        self.llm = engine.llm
        self.text = TokenText(self.llm.tokenizer)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_of: dict[str, int] = {}
        self.total = len(job.prompts) * job.params.n

    async def start(self) -> None:
        try:
            for i, ids in enumerate(self.job.prompts):
                rid = self.job.request_id(i)
                self.prompt_of[rid] = i
                await self.engine.add(rid, ids, self.job.params, self.queue)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for rid in self.prompt_of:
            self.engine.abort(rid)

    # -- text of a choice ----------------------------------------------------------------------
    def _special_text(self, c: _Choice) -> str:
        """The completion decoded with special tokens (the trailing EOS dropped), cut at a stop string."""
        ids = c.ids
        while ids and ids[-1] in self.llm.engine.eos:
            ids = ids[:-1]
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=False)
        hits = [i for i in (text.find(s) for s in self.job.params.stop) if i >= 0]
        return text[: min(hits)] if hits else text

    def _special_step(self, c: _Choice, d: Delta) -> list[dict]:
        """Streamed: the delta's tokens added to the choice's special-token text (EOS dropped, cut at a
        stop string), then the stream deltas of its parse. Runs on a worker thread."""
        done = d.finish_reason is not None
        toks = [t for t in d.token_ids if t not in self.llm.engine.eos]
        for i, t in enumerate(toks or [None]):
            piece, stopped = c.special.add(t, finished=done and i == max(len(toks) - 1, 0))
            c.special_text += piece
            if stopped:
                break
        return c.diff.step(c.special_text, final=done)

    def _parses(self) -> bool:
        fmt = self.job.tool_format
        return fmt is not None and self.llm.tokenizer is not None and (self.job.tools_on or fmt.always)

    def _message(self, c: _Choice) -> tuple[dict, str]:
        msg: dict = {"role": "assistant", "content": "".join(c.parts)}
        reason = c.finish_reason
        if self._parses():
            p = self.job.tool_format.parse(self._special_text(c), final=True)
            calls = p.calls if self.job.tools_on else []
            if calls and not self.job.parallel_tool_calls:
                calls = calls[:1]
            msg["content"] = p.content if (p.content or not calls) else None
            if p.reasoning:
                msg["reasoning_content"] = p.reasoning
            if calls:
                msg["tool_calls"] = [call.openai(new_call_id()) for call in calls]
                reason = "tool_calls"
        return msg, reason

    def _choice(self, c: _Choice, index: int, prompt: int) -> dict:
        job, p = self.job, self.job.params
        if self.job.shape.chat:
            msg, reason = self._message(c)
            lps = chat_logprobs(c.logprobs, self.text) if p.logprobs is not None else None
            return {"index": index, "message": msg, "logprobs": lps, "finish_reason": reason}
        text = "".join(c.parts)
        lps = None
        if job.echo:
            text = job.prompt_texts[prompt] + text
        if p.logprobs is not None:
            entries = (c.prompt_logprobs or []) + c.logprobs if job.echo else c.logprobs
            lps = completion_logprobs(entries, self.text, job.prompts[prompt][0])
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason}

    # -- whole response ------------------------------------------------------------------------
    async def collect(self, request: Request):
        """The whole response, or a 499 (engine requests aborted) the moment the client goes away: the
        disconnect is awaited (the server's http.disconnect message), not polled, so a request that
        would finish soon after its client left is aborted too."""
        task = asyncio.ensure_future(self._gather())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                log.info("request %s aborted: client disconnected", self.job.shape.request_id)
                return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                self.abort()
        got = task.result()
        if isinstance(got, str):
            fits = "does not fit" in got
            raise ApiError(
                got, status=400 if fits else 500, type="invalid_request_error" if fits else "server_error"
            )
        return JSONResponse(await run_in_threadpool(self._whole, got))  # decoding and parsing off the loop

    def _whole(self, got: dict[tuple[int, int], _Choice]) -> dict:
        choices, prompt_finals, finals = [], [], []
        for i in range(len(self.job.prompts)):
            samples = [got[(i, j)] for j in range(self.job.params.n)]
            prompt_finals.append(samples[0].final)
            finals += [s.final for s in samples]
            if len(samples) > self.job.n:  # best_of
                samples = sorted(samples, key=lambda s: -s.final.cumulative_logprob)[: self.job.n]
            choices += [self._choice(s, i * self.job.n + j, i) for j, s in enumerate(samples)]
        return self.job.shape.full(choices, usage(prompt_finals, finals), prompt_finals[0].timings)

    async def _gather(self) -> dict[tuple[int, int], _Choice] | str:
        choices: dict[tuple[int, int], _Choice] = {}
        left = self.total
        while left:
            d: Delta = await self.queue.get()
            if d.error is not None:
                self.abort()
                return d.error
            choices.setdefault((self.prompt_of[d.request_id], d.index), _Choice()).add(d)
            left -= d.finish_reason is not None
        return choices

    # -- stream ---------------------------------------------------------------------------------
    def stream(self) -> StreamingResponse:
        return StreamingResponse(
            self._events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(self):
        shape, job = self.job.shape, self.job
        choices: dict[int, _Choice] = {}
        prompt_finals: dict[int, Final] = {}
        finals: list[Final] = []
        left = self.total
        try:
            if shape.chat:
                for k in range(self.total):
                    yield shape.chunk(
                        {
                            "index": k,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
            while left:
                d: Delta = await self.queue.get()
                if d.error is not None:
                    yield error_event(d.error)
                    self.abort()
                    break
                prompt = self.prompt_of[d.request_id]
                k = prompt * job.n + d.index
                first = k not in choices
                c = choices.get(k)
                if c is None:
                    c = choices[k] = _Choice()
                    if self._parses():
                        c.diff = StreamDiff(job.tool_format)
                        c.special = StopText(self.llm.tokenizer, job.params.stop, skip_special_tokens=False)
                c.add(d)
                parsed = await run_in_threadpool(self._special_step, c, d) if c.diff is not None else None
                if first and job.echo and not shape.chat:
                    lps = None
                    if job.params.logprobs is not None:
                        lps = completion_logprobs(c.prompt_logprobs or [], self.text, job.prompts[prompt][0])
                    yield shape.chunk(
                        {"index": k, "text": job.prompt_texts[prompt], "logprobs": lps, "finish_reason": None}
                    )
                for event in self._delta_events(c, d, k, parsed):
                    yield event
                if d.finish_reason is not None:
                    left -= 1
                    finals.append(d.final)
                    if d.index == 0:
                        prompt_finals[prompt] = d.final
            else:
                if shape.include_usage:
                    yield shape.usage_chunk(usage(list(prompt_finals.values()), finals))
            yield DONE
        finally:
            if left:  # client disconnected mid-stream (or an error)
                self.abort()
                log.info("request %s aborted: client disconnected", shape.request_id)

    def _delta_events(self, c: _Choice, d: Delta, k: int, parsed: list[dict] | None):
        shape, p = self.job.shape, self.job.params
        done = d.finish_reason is not None
        if not shape.chat:
            lps = (
                completion_logprobs(d.logprobs, self.text) if p.logprobs is not None and d.logprobs else None
            )
            if d.text or lps or done:
                yield shape.chunk(
                    {"index": k, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason},
                    d.final.timings if done else None,
                )
            return
        lps = (
            {"content": chat_content(d.logprobs, self.text), "refusal": None}
            if p.logprobs is not None and d.logprobs
            else None
        )
        if parsed is not None:
            deltas = [
                x
                for x in parsed
                if "tool_calls" not in x
                or (self.job.tools_on and (self.job.parallel_tool_calls or x["tool_calls"][0]["index"] == 0))
            ]
        else:
            deltas = [{"content": d.text}] if d.text else []
        if lps and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            yield shape.chunk(
                {"index": k, "delta": delta, "logprobs": lps if i == 0 else None, "finish_reason": None}
            )
        if done:
            reason = d.finish_reason
            if c.diff is not None and c.diff.calls and self.job.tools_on:
                reason = "tool_calls"
            yield shape.chunk(
                {"index": k, "delta": {}, "logprobs": None, "finish_reason": reason}, d.final.timings
            )
