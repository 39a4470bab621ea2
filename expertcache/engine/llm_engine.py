"""LLMEngine: requests in, tokens out, one scheduler step at a time (used by LLM and the server)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import CheckpointError
from .params import SamplingParams
from .runner import ModelRunner
from .sampler import sample
from .scheduler import Scheduler
from .sequence import Sequence
from .tokenizer import Tokenizer


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None
    seq: Sequence


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # tokens computed in prefill (cached prefix not counted)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...],
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, recorder=None):
        self.runner, self.tokenizer, self.kv = runner, tokenizer, runner.kv
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, runner.states)
        self.seqs: dict[str, Sequence] = {}
        self.counters = EngineCounters()
        self.recorder = recorder

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.runner.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                f"context length of {self.max_model_len} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise CheckpointError("stop strings need the checkpoint's tokenizer.json")
        seq = Sequence(prompt_ids, params, request_id)
        if seq.request_id in self.seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.finish_reason is None:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        work = self.scheduler.schedule()
        outs = []
        for seq, n in [w for w in work if w[1] == 0]:  # rejected at admission
            outs.append(self._finish(seq, seq.finish_reason))
        work = [w for w in work if w[1] > 0]
        if not work:
            return outs
        t0 = time.perf_counter()
        self.runner.model.record_routing = self.recorder is not None
        logits = self.runner.run(work).cpu()  # sampling (and per-request CPU generators) on the host
        dt = time.perf_counter() - t0
        if self.recorder is not None:
            self.recorder.record(self.counters.steps, work, self.runner.model.routing)
        self.counters.steps += 1
        decode = all(seq.phase == "decode" for seq, _ in work)
        if decode:
            self.counters.decode_seconds += dt
        else:
            self.counters.prefill_seconds += dt
        for b, (seq, n) in enumerate(work):
            # prompt tokens computed for the first time (a preempted sequence recomputes its own)
            self.counters.prompt_tokens += max(0, min(seq.num_computed + n, seq.prompt_len) - seq.high_water)
            seq.num_computed += n
            seq.high_water = max(seq.high_water, min(seq.num_computed, seq.prompt_len))
            self.kv.seal(seq.block_ids, seq.tokens[: seq.num_computed])
            if seq.num_computed < len(seq.tokens):
                continue  # prefill chunk without a token to sample yet
            tok = sample(logits[b], seq.params, seq.generator)
            seq.tokens.append(tok)
            self.counters.generated_tokens += 1
            outs.append(self._emit(seq, tok))
        return outs

    def _emit(self, seq: Sequence, tok: int) -> StepOutput:
        p = seq.params
        reason = None
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(seq.generated) >= p.max_tokens:
            reason = "length"
        delta = ""
        if self.tokenizer is not None:
            ids = seq.generated[:-1] if reason == "stop" else seq.generated
            text = self.tokenizer.decode(ids)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                text, reason = text[: min(hits)], "stop"
            if reason is not None:
                upto = len(text)
            elif text.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
                upto = len(seq.text)
            else:  # hold back what could still become a stop string
                upto = max(len(seq.text), len(text) - max((len(s) - 1 for s in p.stop), default=0))
            delta, seq.text = text[len(seq.text):upto], text[:upto]
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, [tok], delta, reason, seq)

    def _finish(self, seq: Sequence, reason: str) -> StepOutput:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        return StepOutput(seq.request_id, [], "", reason, seq)
