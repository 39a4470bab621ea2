"""LLM: the Python API. Loads a checkpoint, builds the expert tiers, generates.

    llm = LLM("path/to/Qwen3-30B-A3B", device="cpu")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from . import kernels
from .engine.kv_cache import KVCache, auto_kv_blocks, default_max_model_len
from .engine.llm_engine import LLMEngine
from .engine.params import RequestOutput, SamplingParams
from .engine.runner import ModelRunner
from .engine.sequence import Sequence
from .engine.state_cache import StateCache
from .engine.tokenizer import Tokenizer
from .errors import CheckpointError, ConfigError
from .experts.compute import with_moe_kernel
from .experts.config import CacheConfig
from .experts.layout import ExpertSource
from .experts.provider import ResidentExperts
from .layers.basic import LOAD_FORMATS, load_quant_method
from .loader.checks import check_layer_count
from .models.mtp import drop_mtp_layers
from .models.registry import open_index, read_config
from .models.transformer import MoETransformer
from .quant.checkpoint import method_from_config
from .units import fmt_bytes, parse_bytes


def default_dtype(device: torch.device) -> torch.dtype:
    # These CPUs have no bf16 matrix instructions: compute in float32 there.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class LLM:
    def __init__(self, model: str | Path | None = None, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                 kv_cache_memory: str | int | None = "auto", block_size: int = 16, prefix_caching: bool = True,
                 progress=False, verbose: bool = False, low_memory: bool = False,
                 record_routing: str | None = None, expert_parallel=None, check_finite: bool = True,
                 revision: str | None = None, lm_head: str | None = None, cpu_math: str = "exact", dense: str | None = None,
                 **cache_options):
        # the arguments every expert-parallel rank builds its own LLM from (callables stay here)
        worker_kwargs = dict(model=model, device=device, dtype=dtype, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             kv_cache_memory=kv_cache_memory, block_size=block_size,
                             prefix_caching=prefix_caching, low_memory=low_memory, check_finite=check_finite,
                             revision=revision, lm_head=lm_head, cpu_math=cpu_math, dense=dense, **cache_options)
        # every cache option checked before anything is read (CacheConfig's invariants)
        self.cache_config = CacheConfig.from_options(low_memory=low_memory, **cache_options)
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 1):
            raise ConfigError(f"max_model_len: an integer >= 1, got {max_model_len!r}")
        if model is None:
            from .demo import demo_model_dir

            model = demo_model_dir(progress=progress)
        from .hub import resolve_model

        self.model_dir = resolve_model(model, revision, download=True, progress=bool(progress))
        self.device = torch.device(device)
        if lm_head is not None:
            load_quant_method(lm_head)  # an unknown format is an error before anything loads
        if dense is not None:
            load_quant_method(dense, "dense")
        try:
            unavailable = kernels.cpu_math_unavailable(cpu_math)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if unavailable:
            raise ConfigError(f"cpu_math={cpu_math!r}: {unavailable}; use cpu_math='exact'")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch.cuda.is_available() is False")
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or default_dtype(self.device)
        self.family, self.cfg, self.hf_config = read_config(self.model_dir)
        if max_model_len is not None and max_model_len > self.cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                              f"{self.cfg.max_position_embeddings} ({self.model_dir / 'config.json'})")
        self.index = open_index(self.model_dir, self.family)
        self.mtp_layers = drop_mtp_layers(self.index, self.cfg, self.hf_config)
        check_layer_count(self.index, self.cfg.num_layers)
        self.quant = method_from_config(self.hf_config)
        self.source = ExpertSource(self.index, self.cfg, self.family.names, self.quant)
        self.source.check_finite = check_finite  # experts: at their first read into any tier
        self.source.ffn = with_moe_kernel(self.source.ffn, self.cache_config.moe_kernel, self.device, self.quant)
        self.parallel = self.group = None
        if expert_parallel is not None and self.cfg.linear_attn is not None:
            raise ConfigError(f"expert_parallel: {self.family.name} is a hybrid linear-attention model; "
                              "expert parallelism supports softmax-attention models only")
        if expert_parallel is not None:
            from .parallel import checkpoint_fingerprint, start

            worker_kwargs["model"] = str(self.model_dir)
            self.parallel, self.group = start(expert_parallel, self.device, worker_kwargs, serve_ep_rank)
            self.group.check_same("checkpoint (config.json + safetensors headers)",
                                  checkpoint_fingerprint(self.model_dir))
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(self.model_dir)
        except CheckpointError as e:
            if "missing tokenizer.json" not in str(e):
                raise
            self.tokenizer = None  # token-id prompts still work; text raises
        self.max_model_len = max_model_len or default_max_model_len(self.cfg.max_position_embeddings)
        self.plan_lines: list[str] = []

        kv_layers = len(self.cfg.attention_layer_ids)  # hybrid models: linear-attention layers keep no KV
        kv_bytes = max(1, KVCache.bytes_per_block(kv_layers, block_size, self.cfg.kv_token_shapes, self.dtype))
        # linear-attention state: one slot per running sequence, plus one for logits()
        state_slots = max_num_seqs + 1 if self.cfg.linear_attn is not None else 0
        state_bytes = state_slots * StateCache.bytes_per_sequence(self.cfg, self.dtype)
        if self.cfg.linear_attn is not None and prefix_caching:
            print("note: prefix caching is off for hybrid linear-attention models (a cached prefix's KV "
                  "blocks cannot restore the linear-attention state)", file=sys.stderr)
            prefix_caching = False
        min_blocks = math.ceil(self.max_model_len / block_size)
        budget = parse_bytes(kv_cache_memory, "kv_cache_memory")
        if budget is None:
            num_blocks = auto_kv_blocks(self.max_model_len, max_num_seqs, kv_bytes, block_size)
        else:
            num_blocks = budget // kv_bytes
            if num_blocks < min_blocks:
                raise ConfigError(
                    f"kv_cache_memory={fmt_bytes(budget)} holds {num_blocks * block_size} tokens, fewer than "
                    f"max_model_len={self.max_model_len}; raise it or lower max_model_len"
                )
        dense_bytes = self.index.nbytes() - self.source.total_nbytes
        bar = tqdm(total=self.index.nbytes(), unit="B", unit_scale=True, desc="loading weights",
                   disable=not progress or callable(progress), leave=False)
        show_plan = bool(progress) and not callable(progress)
        if callable(progress):  # progress(bytes_read, bytes_total), e.g. the server's /health
            total, callback, read = self.index.nbytes(), progress, [0]

            def report(n: int) -> None:
                read[0] += n
                callback(read[0], total)

            bar.update = report
        # the KV cache is sized first so that an 'auto' device budget leaves room for it
        self.experts = None
        try:
            self.experts = self._make_experts(self.cache_config, bar.update, show_plan, num_blocks * kv_bytes + state_bytes)
            self.model = MoETransformer(self.cfg, self.family, self.index, self.experts, self.device, self.dtype,
                                        bar.update, self.quant, low_memory=low_memory, check_finite=check_finite,
                                        lm_head=lm_head, cpu_math=cpu_math, dense=dense)
        except BaseException:
            if self.experts is not None:
                self.experts.close()  # its I/O threads
            raise
        finally:
            bar.close()  # before an error is printed: no half progress bar on its line

        shown = len(self.plan_lines)  # the expert plan, printed before the load
        if cpu_math != "exact":
            self.plan_lines.append(f"cpu math: {cpu_math} ({kernels.CPU_MATH_NOTES[cpu_math]})")
        if dense is not None:
            qw = self.model.dense_quantized
            self.plan_lines.append(f"dense projections: {dense} (group {LOAD_FORMATS[dense]['group_size']}), "
                                   f"quantized at load: {len(qw)} matrices, {fmt_bytes(sum(w.nbytes for w in qw))}"
                                   f"{'' if qw else ' (this model has none of the standard attention / dense MLP kind)'}")
        if lm_head is not None:
            self.plan_lines.append(f"lm_head: {lm_head} (group {LOAD_FORMATS[lm_head]['group_size']}), quantized at "
                                   f"load: {fmt_bytes(self.model.lm_head.nbytes)} read per token")
        self.kv = KVCache(kv_layers, num_blocks, block_size, self.cfg.kv_token_shapes, self.dtype,
                          self.device, prefix_caching)
        self.states = StateCache(self.cfg, state_slots, self.dtype, self.device) if state_slots else None
        self.plan_lines.append(
            f"dense weights {fmt_bytes(dense_bytes)}; KV cache {num_blocks} blocks x {block_size} tokens = "
            f"{fmt_bytes(num_blocks * kv_bytes)} ({num_blocks * block_size} tokens)"
        )
        if self.states is not None:
            self.plan_lines.append(
                f"linear-attention state: {state_slots} sequences x "
                f"{fmt_bytes(StateCache.bytes_per_sequence(self.cfg, self.dtype))} = {fmt_bytes(state_bytes)} "
                f"(fixed per sequence, any context length)")
        self.loaded_lines = self.plan_lines[shown:]  # the plan's lines known only after the load
        if self.group is not None:
            from .parallel.runner import ParallelRunner

            runner = ParallelRunner(self.model, self.kv, self.group, self.experts)
        else:
            runner = ModelRunner(self.model, self.kv, self.states)
        self.engine = LLMEngine(runner, self.tokenizer, self._eos_ids(),
                                self.max_model_len, max_num_seqs, max_num_batched_tokens)
        self.engine.nonfinite_experts, self.engine.expert_name = self.source.nonfinite, self.source.expert_name
        self.record_routing = record_routing  # trace file written by close()
        if record_routing:
            from .trace.recorder import RoutingRecorder

            self.engine.recorder = RoutingRecorder(self)
        if verbose:
            for line in self.plan_lines:
                print(line)

    def _make_experts(self, options: CacheConfig, on_bytes, show_plan: bool, kv_total: int):
        def show(lines):  # the memory plan, before the long load
            if show_plan:
                tqdm.write("\n".join(lines), file=sys.stderr)

        if self.group is not None:
            return self._make_parallel_experts(options, on_bytes, show, kv_total)
        if options.tiered:
            from .experts.budget import dense_compute_bytes
            from .experts.build import build_expert_cache

            cache, plan = build_expert_cache(self.source, self.device, self.dtype, options, progress=on_bytes,
                                             dense_bytes=dense_compute_bytes(self.index, self.dtype, self.device),
                                             kv_bytes=kv_total, on_plan=show)
            self.plan_lines += plan
            return cache
        self.plan_lines.append(
            f"experts: {len(self.source.layers)} layers x {self.cfg.num_experts} x "
            f"{fmt_bytes(self.source.expert_nbytes)} = {fmt_bytes(self.source.total_nbytes)}, all resident"
        )
        show(self.plan_lines)
        return ResidentExperts(self.source, self.device, self.dtype, on_bytes)

    def _make_parallel_experts(self, options: CacheConfig, on_bytes, show, kv_total: int):
        """This rank's share of the experts (its own tiers when budgets are given), behind the EP provider."""
        from .parallel.experts import ExpertParallelExperts
        from .parallel.local import LocalExperts
        from .parallel.placement import balanced_placement, static_placement

        cfg, group, layers, E = self.parallel, self.group, self.source.layers, self.cfg.num_experts
        if cfg.num_redundant_experts:
            placement = balanced_placement(torch.zeros(len(layers), E), layers, group.world_size,
                                           cfg.num_redundant_experts)
        else:
            placement = static_placement(layers, E, group.world_size)
        owned = placement.owned(group.rank)
        n = sum(len(v) for v in owned.values())
        self.plan_lines.append(
            f"expert parallel: rank {group.rank} of {group.world_size} holds {n} of {len(layers) * E} experts "
            f"({cfg.num_redundant_experts} redundant per layer; EPLB {'on' if cfg.eplb else 'off'})")
        if options.tiered:
            from .experts.budget import dense_compute_bytes
            from .experts.build import build_expert_cache

            local, plan = build_expert_cache(self.source, self.device, self.dtype, options, progress=on_bytes,
                                             dense_bytes=dense_compute_bytes(self.index, self.dtype, self.device),
                                             kv_bytes=kv_total, on_plan=show)
            self.plan_lines += plan
        else:
            show(self.plan_lines)
            local = LocalExperts(self.source, self.device, self.dtype, owned, on_bytes)
        from .parallel.peer import build as build_peer

        peer, moves, line = build_peer(group, cfg.peer_tier, local, self.source, options.cost_profile)
        if line:
            self.plan_lines.append(line)
        return ExpertParallelExperts(group, local, placement, cfg, layers, E, peer, moves)

    def serve_worker(self) -> None:
        """Expert-parallel ranks 1..N-1: mirror rank 0's forwards until it stops."""
        self.engine.runner.serve_worker()

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # -- text <-> ids -------------------------------------------------------------------------------
    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise CheckpointError(f"{self.model_dir}: missing tokenizer.json (needed to turn text into tokens)")
        return self.tokenizer

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.require_tokenizer().encode(prompt)
        return [int(t) for t in prompt]

    # -- public API ---------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
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

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Full-sequence logits [len(token_ids), vocab] in float32 (evaluation, perplexity)."""
        seq = Sequence(list(token_ids), SamplingParams(max_tokens=1))
        if not token_ids or len(token_ids) > self.max_model_len:
            raise ValueError(f"token_ids must have 1..{self.max_model_len} tokens, got {len(token_ids)}")
        sched = self.engine.scheduler
        rows = []
        try:
            while seq.num_computed < len(seq.tokens):
                n = min(seq.num_uncomputed, sched.budget)
                if not sched.grow(seq, seq.num_computed + n):
                    raise MemoryError("KV cache is busy; call logits() when no generation is running")
                rows.append(self.engine.runner.run([(seq, n)], all_logits=True))
                seq.num_computed += n
        finally:
            sched.free(seq)
        return torch.cat(rows).cpu()

    @property
    def grammars(self):
        """engine.structured.Grammars for this model's tokenizer, built on first use (needs llguidance)."""
        if getattr(self, "_grammars", None) is None:
            from .engine.structured import Grammars

            tok = self.require_tokenizer()
            self._grammars = Grammars(tok.tok.to_str(), self.cfg.vocab_size, tok.vocab_size, list(self._eos_ids()))
        return self._grammars

    def expert_stats(self) -> dict:
        if self.group is not None:  # every rank's counters as of now (called on the engine thread)
            self.engine.runner.refresh_stats()
        return self.experts.stats()

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.tokens[: seq.prompt_len], seq.generated, seq.text,
                             seq.finish_reason, seq.num_cached, seq.index, seq.cumulative_logprob, seq.logprobs,
                             seq.prompt_logprobs)

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


def serve_ep_rank(kwargs: dict, group) -> None:
    """A spawned expert-parallel rank 1..N-1 (parallel/worker.py joined `group`): build the same LLM
    and mirror rank 0 until it stops."""
    cfg = kwargs.pop("expert_parallel")
    llm = LLM(**kwargs, expert_parallel=(cfg, group))
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
