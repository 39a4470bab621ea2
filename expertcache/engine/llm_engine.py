"""LLMEngine: requests in, tokens out, one scheduler step at a time (used by LLM and the server).

Failure isolation: a sequence whose logits are not finite, or whose sampling, detokenising or
stop-string check raises, is finished with reason "error: <why>" on its own (its KV blocks freed
and their prefix hashes dropped); the other sequences of the step go on. A model step that raises
is retried one sequence at a time: only those that fail alone end with the error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..errors import CheckpointError
from .params import ParamError, SamplingParams, check_batch, check_context
from .runner import ModelRunner
from .sampler import prompt_logprobs, row_stats, sample_batch
from .scheduler import Scheduler
from .sequence import Sequence
from .stop_text import StopText
from .tokenizer import Tokenizer

log = logging.getLogger("expertcache")


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None
    seq: Sequence
    index: int = 0  # sample number within the request (n > 1)
    logprobs: list | None = None  # TokenLogprob of each new token, when the request asked for them


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # tokens computed in prefill (cached prefix not counted)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    extra: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        recorder=None,
        max_logits_rows: int | None = None,
    ):
        self.runner, self.tokenizer, self.kv = runner, tokenizer, runner.kv
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(
            self.kv, max_num_seqs, max_num_batched_tokens, runner.states, max_logits_rows
        )
        self.seqs: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples
        self.counters = EngineCounters()
        self.recorder = recorder
        self.record_max_steps: int | None = (
            None  # steps the recorder keeps; then recording stops (logged once)
        )
        self.record_stopped = False
        # (layer, expert) -> parts found non-finite at first read (ExpertSource.nonfinite, live)
        self.nonfinite_experts: dict[tuple[int, int], list[str]] = {}
        self.expert_name = None  # (layer, expert) -> the checkpoint's tensor names, for messages
        self.texts: dict[int, StopText] = {}  # seq_id -> its text and stop-string state (unfinished samples)

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        if not prompt_ids:
            raise ParamError("prompt", "is empty: at least one token is needed")
        vocab = self.runner.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ParamError("prompt", f"token ids must be in [0, {vocab})")
        check_context(len(prompt_ids), params.max_tokens, self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise CheckpointError("stop strings need the checkpoint's tokenizer.json")
        check_batch(params.n, self.scheduler.max_num_seqs)  # samples run together
        vocab_bad = [t for t in params.logit_bias if not 0 <= t < vocab]
        if vocab_bad:
            raise ParamError("logit_bias", f"token id {vocab_bad[0]} is outside the vocabulary [0, {vocab})")
        seq = Sequence(prompt_ids, params, request_id)
        if seq.request_id in self.seqs:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.seqs[seq.request_id] = [seq]
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        for seq in self.seqs.pop(request_id, []):
            self.texts.pop(seq.seq_id, None)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def samples(self, request_id: str) -> list[Sequence]:
        """The unfinished samples of a request (empty once all finished)."""
        return list(self.seqs.get(request_id, []))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        # the whole step (forward, checks, sampling) in the forward's thread arrangement on the CPU:
        # torch's own ops on one thread (their OpenMP barriers would wait on the kernel threads' cores),
        # the C++ kernels on torch's thread count (the forward's own cpu_threads then changes nothing)
        with kernels.cpu_threads(self.runner.model.device):
            return self._step()

    def _step(self) -> list[StepOutput]:
        """One scheduled step: the model on every scheduled sequence's rows, then each sequence that has
        its next-token logits samples (forks first) and takes its token. A failure is its sequence's
        only (the step is rerun one by one when the model fails)."""
        work = self.scheduler.schedule()
        outs = [self._finish(seq, seq.finish_reason) for seq, n in work if n == 0]  # rejected at admission
        work = [w for w in work if w[1] > 0]
        if not work:
            return outs
        t0 = time.perf_counter()
        recording = self._recording()
        self.runner.model.record_routing = recording
        full = [Scheduler.needs_logits(seq) for seq, _ in work]
        try:
            logits, spans = self.runner.run_rows(work, full)
        except Exception as e:  # noqa: BLE001 - find the sequence at fault instead of failing them all
            if getattr(self.runner, "group", None) is not None:  # expert parallel: ranks step together
                raise
            log.exception("a step of %d sequences failed; running them one by one", len(work))
            return outs + self._isolate_step_failure(work, e)
        logits = logits.cpu()  # sampling (and per-request CPU generators) on the host
        self._count_step(work, time.perf_counter() - t0, recording)
        stats = row_stats(logits)  # (finite, logsumexp, argmax, max) [R]: one pass over the final logits
        ready = self._advance(work, full, logits, spans, stats[0].tolist(), outs)
        if ready:
            outs += self._sample_and_accept(ready, logits, stats)
        return outs

    def _count_step(self, work, seconds: float, recording: bool) -> None:
        if recording:
            self.recorder.record(self.counters.steps, work, self.runner.model.routing)
        self.counters.steps += 1
        if all(seq.phase == "decode" for seq, _ in work):
            self.counters.decode_seconds += seconds
        else:
            self.counters.prefill_seconds += seconds

    def _advance(self, work, full, logits, spans, finite, outs) -> list[tuple[Sequence, int]]:
        """Each sequence past the rows it computed (prompt logprobs kept, full KV blocks sealed) ->
        (sequence, row of its next-token logits) for those with a token to sample, forks included; one
        whose logits are not finite fails (into `outs`)."""
        ready: list[tuple[Sequence, int]] = []
        for b, (seq, n) in enumerate(work):
            if full[b]:
                self._record_prompt_logprobs(seq, n, logits[spans[b].start : spans[b].stop])
            # prompt tokens computed for the first time (a preempted sequence recomputes its own)
            self.counters.prompt_tokens += max(0, min(seq.num_computed + n, seq.prompt_len) - seq.high_water)
            seq.num_computed += n
            seq.high_water = max(seq.high_water, min(seq.num_computed, seq.prompt_len))
            self.kv.seal(seq.block_ids, seq.tokens[: seq.num_computed])
            if seq.num_computed < len(seq.tokens):
                continue  # prefill chunk without a token to sample yet
            row = spans[b].stop - 1
            if not finite[row]:
                outs.append(self._fail(seq, self._nonfinite_message(row)))
                continue
            ready += [(s, row) for s in [seq] + self._fork(seq)]
        return ready

    def _sample_and_accept(self, ready, logits, stats) -> list[StepOutput]:
        """Sample every ready sequence's token in one batch (one by one when the batch fails, so that a
        failure is its sequence's only) and take it."""
        outs = []
        seqs = [s for s, _ in ready]
        picked = [r for _, r in ready]
        if picked == list(range(logits.shape[0])):  # every row once, in order (decode): no copy
            rows = logits
        else:
            index = torch.tensor(picked)
            rows, stats = logits[index], tuple(t[index] for t in stats)
        try:
            sampled = list(zip(seqs, *sample_batch(rows, seqs, self.eos, stats)))
        except Exception:  # noqa: BLE001 - find the sequence at fault: each alone, failures finish alone
            sampled = []
            for b, seq in enumerate(seqs):
                try:
                    toks, entries = sample_batch(rows[b : b + 1], [seq], self.eos)
                    sampled.append((seq, toks[0], entries[0]))
                except Exception as e:  # noqa: BLE001
                    log.exception("request %s: sampling failed", seq.request_id)
                    outs.append(self._fail(seq, f"sampling failed: {type(e).__name__}: {e}"))
        for seq, tok, entry in sampled:
            try:
                outs.append(self._accept(seq, tok, entry))
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                log.exception("request %s failed in its step", seq.request_id)
                outs.append(self._fail(seq, f"{type(e).__name__}: {e}"))
        return outs

    def _recording(self) -> bool:
        """Whether this step's routing goes to the recorder: until record_max_steps steps (then a
        warning, once; the trace keeps the steps recorded)."""
        if self.recorder is None:
            return False
        if self.record_max_steps is None or self.counters.steps < self.record_max_steps:
            return True
        if not self.record_stopped:
            self.record_stopped = True
            log.warning(
                "routing recording stopped after %d engine steps (--record-routing-max-steps); the trace "
                "keeps those steps",
                self.record_max_steps,
            )
        return False

    def _accept(self, seq: Sequence, tok: int, entry) -> StepOutput:
        seq.tokens.append(tok)
        seq.cumulative_logprob += entry[1]
        if seq.logprobs is not None:
            seq.logprobs.append(entry)
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.accept(tok):  # only a grammar with no way forward gets here
                return self._finish(seq, f"error: the grammar allows no token here ({seq.matcher.error()})")
            grammar_done = seq.matcher.stopped
        self.counters.generated_tokens += 1
        return self._emit(seq, tok, grammar_done)

    def _nonfinite_message(self, b: int) -> str:
        """Why logits row b is NaN/inf: the first layer whose output was not finite, and the
        experts of that layer found non-finite at their first read."""
        msg = "the model produced non-finite logits (NaN or inf) for this request"
        after = self.runner.model.finite_after
        bad = [] if after is None else (~after[:, b]).nonzero().flatten().tolist()
        layer = bad[0] if bad else None
        if layer is not None:
            msg += f"; its hidden state first became non-finite in layer {layer}"
        experts = [k for k in self.nonfinite_experts if layer is None or k[0] == layer]
        if experts:
            names = [
                self.expert_name(*k) if self.expert_name else f"layer {k[0]} expert {k[1]}"
                for k in experts[:3]
            ]
            return msg + f"; likely cause: non-finite expert weights ({', '.join(names)})"
        return msg + (
            "; likely cause: non-finite weights (the checkpoint's tensors are scanned at load unless "
            "--no-check-finite) or an overflow of the compute dtype"
        )

    def _isolate_step_failure(self, work: list[tuple[Sequence, int]], error: Exception) -> list[StepOutput]:
        """The model step of `work` raised: run each sequence alone (nothing sampled, nothing advanced:
        its KV slots are rewritten with the same values next step); those that fail alone end with the
        error, the others run again in the next step."""
        failed = []
        for seq, n in work:
            err = error
            if len(work) > 1:
                try:
                    self.runner.run_rows([(seq, n)], [False])
                    continue
                except Exception as e:  # noqa: BLE001
                    err = e
            failed.append(self._fail(seq, f"the model step failed: {type(err).__name__}: {err}"))
        if self.scheduler.states is not None:
            # hybrid models: the failed step (and the trial) advanced the linear-attention states in
            # place, unlike KV slots they cannot be rewritten: the survivors recompute from token 0
            for seq, _ in work:
                if seq.finish_reason is None and seq in self.scheduler.running:
                    self.scheduler.preempt(seq)
        return failed

    def _fail(self, seq: Sequence, why: str) -> StepOutput:
        self.kv.forget(seq.block_ids)
        return self._finish(seq, f"error: {why}")

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Sample 0 of an n > 1 request has its prompt computed: start its siblings on the same blocks."""
        children = []
        for i in range(1, seq.pending_forks + 1):
            child = seq.fork(i)
            self.kv.acquire(seq.block_ids)
            child.block_ids = list(seq.block_ids)
            if self.scheduler.states is not None:  # hybrid models: its own copy of the prompt's state
                child.state_slot = self.scheduler.states.fork(seq.state_slot)
            self.scheduler.running.append(child)
            self.seqs[seq.request_id].append(child)
            children.append(child)
        seq.pending_forks = 0
        return children

    def _record_prompt_logprobs(self, seq: Sequence, n: int, rows: torch.Tensor) -> None:
        """rows [n, V]: logits at positions num_computed .. num_computed+n-1, each predicting the next token."""
        start = seq.num_computed
        targets = seq.tokens[start + 1 : min(start + n + 1, seq.prompt_len)]
        for i, entry in enumerate(prompt_logprobs(rows, targets, seq.params.prompt_logprobs)):
            seq.prompt_logprobs[start + 1 + i] = entry

    def _emit(self, seq: Sequence, tok: int, grammar_done: bool = False) -> StepOutput:
        p = seq.params
        reason = None
        stop_token = (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids
        if stop_token or grammar_done:  # a complete grammar allows nothing more
            reason = "stop"
        elif len(seq.generated) >= p.max_tokens:
            reason = "length"
        delta = ""
        if self.tokenizer is not None:
            text = self.texts.get(seq.seq_id)
            if text is None:
                text = self.texts[seq.seq_id] = StopText(self.tokenizer, p.stop)
            delta, stopped = text.add(None if stop_token else tok, finished=reason is not None)
            if stopped:
                reason = "stop"
            seq.text += delta
        if reason is not None:
            self._finish(seq, reason)
        lps = [seq.logprobs[-1]] if seq.logprobs is not None else None
        return StepOutput(seq.request_id, [tok], delta, reason, seq, seq.index, lps)

    def _finish(self, seq: Sequence, reason: str) -> StepOutput:
        seq.finish_reason = reason
        self.texts.pop(seq.seq_id, None)
        self.scheduler.finish(seq)
        group = self.seqs.get(seq.request_id, [])
        if seq in group:
            group.remove(seq)
        if not group:
            self.seqs.pop(seq.request_id, None)
        return StepOutput(seq.request_id, [], "", reason, seq, seq.index)
