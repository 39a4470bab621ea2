"""What every command that loads a model shares, below the commands themselves.

cli.py, chat_cli.py and server/ take these from here (so chat_cli.py and server/ never import
cli.py, which registers them as subcommands): the engine flags (`add_engine_args`) and their LLM
keywords (`engine_kwargs`: the flags are EngineConfig's fields by name, `engine_flags`; the
expert-parallel `parallel_config`), the model argument (`resolve_model_arg`, `model_dir_arg`), one prompt streamed
to the terminal (`stream_request`), `error_line` (any error as one line, also for /health) and
`run_command`: any error one line on stderr, exit 2 (`--debug`: the traceback).
Light to import (argparse; torch and the model only when a command runs).
"""

from __future__ import annotations

import argparse
import sys

from .experts.policy import ONLINE  # numpy only: the policy names for --cache-policy


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model, in --help's order."""
    add_model_args(p)
    add_runtime_args(p)
    add_weight_args(p)
    add_cache_args(p)
    add_parallel_args(p)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Which model: the checkpoint (or hub id) and its tokenizer."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory (config.json + safetensors), hub id such as Qwen/Qwen3-30B-A3B (found in "
        "the Hugging Face cache, else downloaded if huggingface_hub is installed), or a hub-cache "
        "folder models--ORG--NAME; default: the built-in demo model",
    )
    p.add_argument("--revision", default=None, help="hub id only: branch, tag or commit (default: main)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a directory with tokenizer.json (+ tokenizer_config.json) to use instead of the model's "
        "own (default: the checkpoint's, or a GGUF file's metadata)",
    )


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Where and how wide the engine runs: device, dtype, context, batch, KV budget, threads."""
    p.add_argument("--device", default="cpu", help="compute device: cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: min(model, 4096))",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=16, help="most sequences decoded together (default: 16)"
    )
    p.add_argument("--kv-cache-memory", default="auto", help="KV cache budget, e.g. 512MiB (default: auto)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads for torch and the CPU kernels (default: torch's choice, one per core; on a "
        "busy shared machine 1 avoids OpenMP contention)",
    )


def add_weight_args(p: argparse.ArgumentParser) -> None:
    """How the dense part is held and run (low memory, load-time quantization, the CPU kernels' math),
    the finite checks, the routing record."""
    p.add_argument(
        "--low-memory",
        action="store_true",
        help="CPU: keep dense weights and the fastest expert tier in the checkpoint's dtype, converted "
        "per use (about half the RAM, some speed), and an untied embedding table on disk (its rows "
        "read per token); allows --host-memory 0 (misses read from disk straight into expert slots)",
    )
    p.add_argument(
        "--lm-head",
        choices=["int8", "int4"],
        default=None,
        help="quantize lm_head at load (int8 or int4 with zero points, group 128): int8 reads half its "
        "bf16 bytes per token, int4 about a quarter (default: as stored)",
    )
    p.add_argument(
        "--dense",
        choices=["int8", "int4"],
        default=None,
        help="quantize the dense projections at load (int8 or int4, group 128): a standard attention's "
        "q/k/v/o, dense MLPs and shared experts (default: as stored)",
    )
    p.add_argument(
        "--cpu-math",
        choices=["auto", "exact", "fast"],
        default="auto",
        help="how the CPU kernels multiply: fast = as llama.cpp, bf16 weights against activations "
        "rounded to bf16 and int8/4-bit weights against activations quantized to int8 (AVX-512 "
        "BF16/VNNI); exact = float32 activations, transformers' logits; auto (default) = fast "
        "where the CPU has it, else exact (held-out perplexity +0.05-0.07%%: docs/numerics.md)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="CUDA: capture decode's dense segments between MoE layers (attention, norms, router) as CUDA "
        "graphs per batch-size bucket and replay them around the eager MoE op; refused on the CPU. Off by "
        "default: not yet run on a GPU (docs/gpu.md)",
    )
    p.add_argument(
        "--no-check-finite",
        dest="check_finite",
        action="store_false",
        help="skip the NaN/inf scan of dense weights at load and of each expert at its first read",
    )
    p.add_argument(
        "--record-routing",
        default=None,
        metavar="FILE",
        help="write the routing trace (.npz, see `expertcache trace`) when the command ends",
    )


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """The expert cache's budgets, policy, prefetch and compute paths."""
    g = p.add_argument_group("expert cache")
    g.add_argument(
        "--device-memory",
        default=None,
        help="on cuda: everything the engine takes on the GPU (dense weights, KV cache, activations, "
        "logits, expert slots, context), e.g. 8GiB, or 'auto' (free VRAM less 512 MiB); on cpu: "
        "the fastest expert tier, e.g. 512MiB; 25%% (of all the routed experts' bytes) puts that "
        "share in the fastest tier; omit all cache flags to keep every expert resident",
    )
    g.add_argument(
        "--host-memory",
        default=None,
        help="budget for experts in host RAM, e.g. 2GiB, 50%%, or 'auto'; 0 needs --low-memory",
    )
    g.add_argument(
        "--cache-policy",
        default=None,
        choices=ONLINE,
        help="eviction policy of the expert cache (needs --device-memory or --host-memory; "
        "default: adaptive)",
    )
    g.add_argument(
        "--prefetch",
        nargs="?",
        const="device",
        default=None,
        choices=["auto", "device", "host", "off"],
        help="read the next layer's predicted experts ahead: device = into device slots (default with "
        "CUDA; bare --prefetch), host = disk reads into host RAM only (default on a CPU-only "
        "machine with a partial host tier), auto, off",
    )
    g.add_argument(
        "--no-prefetch", dest="prefetch", action="store_const", const="off", help="turn prefetch off"
    )
    g.add_argument(
        "--cpu-compute",
        choices=["auto", "always", "never"],
        default=None,
        help="compute missing experts on the CPU from host RAM: auto (cost model), always, never",
    )
    g.add_argument(
        "--moe-kernel",
        choices=["auto", "triton", "torch"],
        default=None,
        help="what computes the experts in device memory (with or without a budget): triton = the fused "
        "Triton MoE (CUDA; on --device cpu only under TRITON_INTERPRET=1, for tests), torch = "
        "torch/C++ kernels, auto = triton on CUDA where it is installed (default)",
    )
    g.add_argument(
        "--load-expert-stats", default=None, metavar="FILE", help="warm start from saved expert statistics"
    )
    g.add_argument(
        "--save-expert-stats", default=None, metavar="FILE", help="save expert use statistics at exit"
    )


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("expert parallel (torch.distributed: gloo on CPU, NCCL on CUDA)")
    e.add_argument(
        "--expert-parallel",
        type=int,
        default=None,
        metavar="N",
        help="spread every MoE layer's experts over N ranks (spawned processes here, or the ranks "
        "torchrun started); attention and dense weights are replicated; cache budgets are per rank",
    )
    e.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        metavar="R",
        help="extra physical experts per layer: replicas of the hottest experts (default: 0)",
    )
    e.add_argument(
        "--enable-eplb",
        action="store_true",
        help="rebalance the placement from the measured expert load (replicas + balanced packing)",
    )
    e.add_argument(
        "--eplb-window-size",
        type=int,
        default=None,
        help="steps of load the balancer uses (with --enable-eplb; default: 1000)",
    )
    e.add_argument(
        "--eplb-step-interval",
        type=int,
        default=None,
        help="steps between rebalances (with --enable-eplb; default: 3000)",
    )
    e.add_argument(
        "--peer-tier",
        choices=("auto", "on", "off"),
        default=None,
        help="a rank's expert missing from its memory that another rank holds in memory comes over the "
        "link instead of from its disk (and EPLB moves take bytes from the old rank): auto = when "
        "the cost model says the link (measured at start) beats the disk (default: auto)",
    )
    e.add_argument(
        "--ep-timeout",
        type=float,
        default=None,
        help="seconds a rank may stay silent before the group stops with an error (default: 120)",
    )


def parallel_config(args: argparse.Namespace):
    """-> ParallelConfig or None; the EP flags without --expert-parallel are an error."""
    from .parallel.config import ParallelConfig

    if args.expert_parallel is None:
        given = [
            f
            for f, v in (
                ("--enable-eplb", args.enable_eplb),
                ("--num-redundant-experts", args.num_redundant_experts),
                ("--eplb-window-size", args.eplb_window_size),
                ("--eplb-step-interval", args.eplb_step_interval),
                ("--ep-timeout", args.ep_timeout),
                ("--peer-tier", args.peer_tier),
            )
            if v
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: need --expert-parallel N")
        return None
    timeout = {} if args.ep_timeout is None else {"timeout_s": args.ep_timeout}
    peer = {} if args.peer_tier is None else {"peer_tier": args.peer_tier}
    return ParallelConfig(
        args.expert_parallel,
        args.num_redundant_experts,
        args.enable_eplb,
        args.eplb_window_size,
        args.eplb_step_interval,
        exit_on_failure=True,
        **timeout,
        **peer,
    )


# flags that are not engine options: what the command does around the engine (--revision: the model
# argument is resolved to its snapshot directory by resolve_model_arg before the engine starts)
COMMAND_FLAGS = ("threads", "save_expert_stats", "revision")
# flags of add_parallel_args: they make the one `expert_parallel` option (parallel_config)
PARALLEL_FLAGS = (
    "expert_parallel",
    "num_redundant_experts",
    "enable_eplb",
    "eplb_window_size",
    "eplb_step_interval",
    "peer_tier",
    "ep_timeout",
)
FLAG_KEYWORDS = {
    "load_expert_stats": "load_stats"
}  # a flag's dest -> its EngineConfig keyword, where they differ


def engine_flags() -> list[str]:
    """The dests of add_engine_args' flags that are engine options (config.EngineConfig keywords, after
    FLAG_KEYWORDS): tests/cli/test_cli_errors.py checks them against EngineConfig.keywords()."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    dests = dict.fromkeys(a.dest for a in p._actions)
    return [d for d in dests if d not in COMMAND_FLAGS and d not in PARALLEL_FLAGS]


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The flags given as LLM's keywords (EngineConfig's fields by name; a flag left at None is not given)."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    kw = {FLAG_KEYWORDS.get(d, d): getattr(args, d) for d in engine_flags() if getattr(args, d) is not None}
    kw["progress"] = True
    ep = parallel_config(args)
    if ep is not None:
        kw["expert_parallel"] = ep
    return kw


def resolve_model_arg(args: argparse.Namespace, download: bool = True) -> None:
    """Replace args.model (directory, hub id or hub-cache folder) by its checkpoint directory, before any
    weight is read; what the user typed stays in args.model_spec."""
    args.model_spec = args.model
    if args.model is not None:
        from .hub import resolve_model

        args.model = str(resolve_model(args.model, getattr(args, "revision", None), download=download))


def model_dir_arg(args: argparse.Namespace) -> str:
    """args.model resolved to a checkpoint directory (the demo model when none was given)."""
    resolve_model_arg(args)
    if args.model is None:
        from .demo import demo_model_dir

        args.model = str(demo_model_dir())
    return args.model


def stream_request(llm, ids: list[int], sp, out=sys.stdout) -> str:
    """Generate for one prompt, printing text as it comes; returns the stats line of this request."""
    eng = llm.engine
    c = eng.counters
    before = (c.prompt_tokens, c.prefill_seconds, c.generated_tokens, c.decode_seconds)
    eng.add_request(ids, sp)
    while eng.has_unfinished():
        for o in eng.step():
            print(o.text_delta, end="", flush=True, file=out)
    print(file=out)
    ptok, psec, gtok, dsec = (
        a - b
        for a, b in zip((c.prompt_tokens, c.prefill_seconds, c.generated_tokens, c.decode_seconds), before)
    )
    pre = ptok / psec if psec else 0.0
    dec = (gtok - 1) / dsec if dsec else 0.0
    line = (
        f"prompt tokens {len(ids)}, generated tokens {gtok}, prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s"
    )
    stats = llm.expert_stats()
    if "per_tier" in stats:
        from .experts.stats import summary_line

        line += "; " + summary_line(stats)
    if "expert_parallel" in stats:
        from .parallel.experts import summary_line as ep_summary

        line += "; " + ep_summary(stats["expert_parallel"])
    return line


def error_line(e: BaseException) -> str:
    """One line for any error: the project's own errors by their message, others with their type."""
    from .errors import ExpertCacheError

    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if isinstance(e, (ExpertCacheError, ValueError)) else f"{type(e).__name__}: {msg}"


def run_command(func, args, debug: bool = False) -> int:
    """Run one subcommand: any error becomes one line on stderr and exit code 2 (a traceback with
    --debug); Ctrl-C is 130."""
    try:
        return func(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"error: {error_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 2
