"""LLM: the Python API, a thin facade. build/ constructs the engine (plan -> allocate -> fill); LLM
generates, evaluates logits, reports expert statistics and closes.

    llm = LLM("path/to/Qwen3-30B-A3B", device="cpu")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import os
import sys
from operator import attrgetter

import torch
from tqdm import tqdm

from .build import build_engine, eos_ids
from .config import EngineConfig
from .engine.params import RequestOutput, SamplingParams
from .engine.sequence import Sequence
from .engine.tokenizer import Tokenizer
from .errors import CheckpointError

__all__ = ["LLM", "default_dtype", "run_torchrun_worker", "serve_ep_rank"]


def default_dtype(device: torch.device) -> torch.dtype:
    """The compute dtype when none is given (config.LoadConfig.torch_dtype)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _via(path: str) -> property:
    """A read-only attribute of what construction made (llm.cfg is llm.checkpoint.cfg, ...)."""
    return property(attrgetter(path))


class LLM:
    """The facade: `LLM(model, **kwargs)` fills an EngineConfig by keyword (config.py: the one list of
    options; an unknown keyword is refused by name) and build.build_engine constructs from it."""

    def __init__(self, model: str | os.PathLike | None = None, **kwargs):
        self._start(EngineConfig.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig, group=None) -> LLM:
        """From a whole EngineConfig; `group`: an expert-parallel rank's joined group (serve_ep_rank)."""
        llm = cls.__new__(cls)
        llm._start(config, group)
        return llm

    def _start(self, config: EngineConfig, group=None) -> None:
        self.config = config
        made = build_engine(config, group, serve_ep_rank)
        self.checkpoint, self.memory, self.engine, self.group = (
            made.checkpoint,
            made.memory,
            made.engine,
            made.group,
        )
        self.record_routing = config.record_routing  # trace file written by close()
        if config.record_routing:
            from .trace.recorder import RoutingRecorder

            self.engine.recorder = RoutingRecorder(self)
        if config.verbose:
            for line in self.plan_lines:
                print(line)

    # what construction made, by name (build/: checkpoint = the headers' answers, memory = plan + ledger)
    model_dir, family, cfg, hf_config = (
        _via("checkpoint.model_dir"),
        _via("checkpoint.family"),
        _via("checkpoint.cfg"),
        _via("checkpoint.hf_config"),
    )
    index, quant, source, mtp_layers = (
        _via("checkpoint.index"),
        _via("checkpoint.quant"),
        _via("checkpoint.source"),
        _via("checkpoint.mtp_layers"),
    )
    tokenizer, max_model_len = _via("engine.tokenizer"), _via("engine.max_model_len")
    model, kv, states = _via("engine.runner.model"), _via("engine.runner.kv"), _via("engine.runner.states")
    experts, device, dtype = (
        _via("engine.runner.model.experts"),
        _via("engine.runner.model.device"),
        _via("engine.runner.model.dtype"),
    )
    device_plan, ledger = _via("memory.plan"), _via("memory.ledger")
    plan_lines, loaded_lines = _via("memory.lines"), _via("memory.loaded_lines")

    def serve_worker(self) -> None:
        """Expert-parallel ranks 1..N-1: mirror rank 0's forwards until it stops."""
        self.engine.runner.serve_worker()

    def _eos_ids(self) -> tuple[int, ...]:
        return eos_ids(self.cfg, self.tokenizer)

    # -- text <-> ids -------------------------------------------------------------------------------
    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise CheckpointError(
                f"{self.model_dir}: missing tokenizer.json (needed to turn text into tokens)"
            )
        return self.tokenizer

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.require_tokenizer().encode(prompt)
        return [int(t) for t in prompt]

    # -- public API ---------------------------------------------------------------------------------
    def generate(
        self, prompts, params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Run a batch of prompts (text or token ids) together; one output per prompt and sample, in
        order (prompt-major: a prompt with n samples gives n outputs, index 0..n-1)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        firsts = [self.engine.add_request(self._prompt_ids(p), sp) for p, sp in zip(prompts, plist)]
        samples: dict[str, list[Sequence]] = {s.request_id: [s] for s in firsts}
        bar = tqdm(total=sum(s.params.n for s in firsts), disable=not use_tqdm, desc="generating")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.seq.index and out.seq not in samples[out.request_id]:
                    samples[out.request_id].append(out.seq)
                if out.finish_reason:
                    bar.update(1)
        bar.close()
        return [self._output(s) for f in firsts for s in sorted(samples[f.request_id], key=lambda q: q.index)]

    def chat(self, messages, params: SamplingParams | None = None, **template_kwargs) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.require_tokenizer()
        return self.generate([tok.encode_chat(c, **template_kwargs) for c in convs], params)

    def logits(self, token_ids: list[int], block_rows: int | None = None) -> torch.Tensor:
        """Full-sequence logits [len(token_ids), vocab] in float32 on the host (evaluation, perplexity).
        The prompt is run `block_rows` tokens at a time (at most the scheduler's token budget), each
        block's logits moved to the host before the next: on a GPU the device never holds more than
        one block's [rows, vocab]. Default: the scheduler's bound on a step's logits rows (the token
        budget on the CPU; on a GPU the rows the device plan counts, build/plan.py)."""
        seq = Sequence(list(token_ids), SamplingParams(max_tokens=1))
        if not token_ids or len(token_ids) > self.max_model_len:
            raise ValueError(f"token_ids must have 1..{self.max_model_len} tokens, got {len(token_ids)}")
        if block_rows is not None and (
            isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1
        ):
            raise ValueError(f"block_rows must be a positive integer, got {block_rows!r}")
        sched = self.engine.scheduler
        step = min(sched.budget, sched.max_logits_rows, block_rows or sched.budget)
        out = torch.empty(len(token_ids), self.cfg.vocab_size, dtype=torch.float32)
        try:
            while seq.num_computed < len(seq.tokens):
                n = min(seq.num_uncomputed, step)
                if not sched.grow(seq, seq.num_computed + n):
                    raise MemoryError("KV cache is busy; call logits() when no generation is running")
                out[seq.num_computed : seq.num_computed + n] = self.engine.runner.run(
                    [(seq, n)], all_logits=True
                )
                seq.num_computed += n
        finally:
            sched.free(seq)
        return out

    @property
    def grammars(self):
        """engine.structured.Grammars for this model's tokenizer, built on first use (needs llguidance)."""
        if getattr(self, "_grammars", None) is None:
            from .engine.structured import Grammars

            tok = self.require_tokenizer()
            self._grammars = Grammars(
                tok.tok.to_str(), self.cfg.vocab_size, tok.vocab_size, list(self._eos_ids())
            )
        return self._grammars

    def expert_stats(self) -> dict:
        if self.group is not None:  # every rank's counters as of now (called on the engine thread)
            self.engine.runner.refresh_stats()
        return self.experts.stats()

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            seq.request_id,
            seq.tokens[: seq.prompt_len],
            seq.generated,
            seq.text,
            seq.finish_reason,
            seq.num_cached,
            seq.index,
            seq.cumulative_logprob,
            seq.logprobs,
            seq.prompt_logprobs,
        )

    def close(self) -> None:
        """Stop the expert tiers' threads; write the routing trace when record_routing was given."""
        if self.record_routing and self.engine.recorder is not None and self.engine.recorder.rows["experts"]:
            self.engine.recorder.save(self.record_routing)
        self.experts.close()
        if self.group is not None:
            if self.group.rank == 0 and not self.group.failed:
                self.engine.runner.stop_workers()
            self.group.close()
            self.group = None


def serve_ep_rank(payload: dict, group) -> None:
    """A spawned expert-parallel rank 1..N-1 (parallel/worker.py joined `group`): build the same LLM from
    rank 0's whole EngineConfig (payload["config"], plain data) and mirror rank 0 until it stops."""
    llm = LLM.from_config(EngineConfig.from_dict(payload["config"]), group)
    try:
        llm.serve_worker()
    finally:
        llm.close()


def run_torchrun_worker(llm_kwargs: dict) -> int:
    """A torchrun rank other than 0: build the same LLM, mirror rank 0 until it stops."""
    llm = LLM(**{**llm_kwargs, "progress": False})
    print(f"expert-parallel rank {os.environ['RANK']} ready", file=sys.stderr)
    try:
        llm.serve_worker()
    finally:
        llm.close()
    return 0
