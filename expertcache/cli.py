"""The `expertcache` command: generate, demo, serve, plan, trace, quantize.

Subcommands living in other packages register through their `add_*_subcommand(subparsers)`;
the heavy work (torch, the model) is imported only when a command runs.
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
    """Flags shared by every command that loads a model."""
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (config.json + safetensors), hub id such as Qwen/Qwen3-30B-A3B (found in "
                        "the Hugging Face cache, else downloaded if huggingface_hub is installed), or a hub-cache "
                        "folder models--ORG--NAME; default: the built-in demo model")
    p.add_argument("--revision", default=None, help="hub id only: branch, tag or commit (default: main)")
    p.add_argument("--device", default="cpu", help="compute device: cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens (default: min(model, 4096))")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together (default: 16)")
    p.add_argument("--kv-cache-memory", default="auto", help="KV cache budget, e.g. 512MiB (default: auto)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch and the CPU kernels (default: torch's choice, one per core; on a "
                        "busy shared machine 1 avoids OpenMP contention)")
    p.add_argument("--low-memory", action="store_true",
                   help="CPU: keep dense weights and the fastest expert tier in the checkpoint's dtype, converted "
                        "per use (about half the RAM, some speed); allows --host-memory 0 (misses read from disk "
                        "straight into expert slots)")
    p.add_argument("--lm-head", choices=["int8"], default=None,
                   help="quantize lm_head at load (int8, group 128): a quarter of its float32 bytes and half its "
                        "bf16 bytes read per token (default: as stored)")
    p.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="skip the NaN/inf scan of dense weights at load and of each expert at its first read")
    p.add_argument("--record-routing", default=None, metavar="FILE",
                   help="write the routing trace (.npz, see `expertcache trace`) when the command ends")
    g = p.add_argument_group("expert cache")
    g.add_argument("--device-memory", default=None,
                   help="budget for experts in the fastest tier (device slots), e.g. 512MiB, 25%% (of all the "
                        "routed experts' bytes), or 'auto'; "
                        "omit all cache flags to keep every expert resident")
    g.add_argument("--host-memory", default=None, help="budget for experts in host RAM, e.g. 2GiB, 50%%, or 'auto'; "
                                                       "0 needs --low-memory")
    g.add_argument("--cache-policy", default=None, choices=ONLINE,
                   help="eviction policy of the expert cache (needs --device-memory or --host-memory; "
                        "default: adaptive)")
    g.add_argument("--prefetch", nargs="?", const="device", default=None, choices=["auto", "device", "host", "off"],
                   help="read the next layer's predicted experts ahead: device = into device slots (default with "
                        "CUDA; bare --prefetch), host = disk reads into host RAM only (default on a CPU-only "
                        "machine with a partial host tier), auto, off")
    g.add_argument("--no-prefetch", dest="prefetch", action="store_const", const="off", help="turn prefetch off")
    g.add_argument("--cpu-compute", choices=["auto", "always", "never"], default=None,
                   help="compute missing experts on the CPU from host RAM: auto (cost model), always, never")
    g.add_argument("--load-expert-stats", default=None, metavar="FILE", help="warm start from saved expert statistics")
    g.add_argument("--save-expert-stats", default=None, metavar="FILE", help="save expert use statistics at exit")
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("expert parallel (torch.distributed: gloo on CPU, NCCL on CUDA)")
    e.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                   help="spread every MoE layer's experts over N ranks (spawned processes here, or the ranks "
                        "torchrun started); attention and dense weights are replicated; cache budgets are per rank")
    e.add_argument("--num-redundant-experts", type=int, default=0, metavar="R",
                   help="extra physical experts per layer: replicas of the hottest experts (default: 0)")
    e.add_argument("--enable-eplb", action="store_true",
                   help="rebalance the placement from the measured expert load (replicas + balanced packing)")
    e.add_argument("--eplb-window-size", type=int, default=None,
                   help="steps of load the balancer uses (with --enable-eplb; default: 1000)")
    e.add_argument("--eplb-step-interval", type=int, default=None,
                   help="steps between rebalances (with --enable-eplb; default: 3000)")
    e.add_argument("--peer-tier", choices=("auto", "on", "off"), default=None,
                   help="a rank's expert missing from its memory that another rank holds in memory comes over the "
                        "link instead of from its disk (and EPLB moves take bytes from the old rank): auto = when "
                        "the cost model says the link (measured at start) beats the disk (default: auto)")
    e.add_argument("--ep-timeout", type=float, default=None,
                   help="seconds a rank may stay silent before the group stops with an error (default: 120)")


def parallel_config(args: argparse.Namespace):
    """-> ParallelConfig or None; the EP flags without --expert-parallel are an error."""
    from .parallel.config import ParallelConfig

    if args.expert_parallel is None:
        given = [f for f, v in (("--enable-eplb", args.enable_eplb), ("--num-redundant-experts", args.num_redundant_experts),
                                ("--eplb-window-size", args.eplb_window_size),
                                ("--eplb-step-interval", args.eplb_step_interval),
                                ("--ep-timeout", args.ep_timeout), ("--peer-tier", args.peer_tier)) if v]
        if given:
            raise ValueError(f"{', '.join(given)}: need --expert-parallel N")
        return None
    timeout = {} if args.ep_timeout is None else {"timeout_s": args.ep_timeout}
    peer = {} if args.peer_tier is None else {"peer_tier": args.peer_tier}
    return ParallelConfig(args.expert_parallel, args.num_redundant_experts, args.enable_eplb, args.eplb_window_size,
                          args.eplb_step_interval, exit_on_failure=True, **timeout, **peer)


def engine_kwargs(args: argparse.Namespace) -> dict:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    kw = dict(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory, progress=True,
              low_memory=args.low_memory, record_routing=args.record_routing, check_finite=args.check_finite,
              lm_head=args.lm_head)
    cache = {"device_memory": args.device_memory, "host_memory": args.host_memory, "cache_policy": args.cache_policy,
             "cpu_compute": args.cpu_compute, "load_stats": args.load_expert_stats}
    if args.prefetch is not None:
        cache["prefetch"] = args.prefetch
    kw.update({k: v for k, v in cache.items() if v is not None})
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
    ptok, psec, gtok, dsec = (a - b for a, b in zip((c.prompt_tokens, c.prefill_seconds, c.generated_tokens,
                                                     c.decode_seconds), before))
    pre = ptok / psec if psec else 0.0
    dec = (gtok - 1) / dsec if dsec else 0.0
    line = f"prompt tokens {len(ids)}, generated tokens {gtok}, prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s"
    stats = llm.expert_stats()
    if "per_tier" in stats:
        from .experts.stats import summary_line

        line += "; " + summary_line(stats)
    if "expert_parallel" in stats:
        from .parallel.experts import summary_line as ep_summary

        line += "; " + ep_summary(stats["expert_parallel"])
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    from .cli_checks import check_prompt_fits, sampling_params
    from .parallel.worker import run_torchrun_worker, torchrun_rank

    sp = sampling_params(args)
    model_dir = model_dir_arg(args)
    if torchrun_rank():  # ranks 1..N-1 under torchrun mirror rank 0
        return run_torchrun_worker(engine_kwargs(args))
    if args.prompt is None:
        from .chat_cli import run_chat

        return run_chat(args, sp, template=args.chat)
    from .engine.tokenizer import Tokenizer
    from .llm import LLM

    tok = Tokenizer(model_dir)
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    check_prompt_fits(args, model_dir, ids)  # all before a weight byte is read
    llm = LLM(**engine_kwargs(args))
    print(llm.plan_lines[-1], file=sys.stderr)  # the KV cache line (the expert plan printed before loading)
    print(stream_request(llm, ids, sp), file=sys.stderr)
    if args.save_expert_stats:
        llm.experts.save_stats(args.save_expert_stats)
    llm.close()
    if args.record_routing:
        print(f"routing trace written to {args.record_routing}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    if args.model is None:
        args.model = str(demo.random_demo_dir(rebuild=args.rebuild) if args.random else demo.demo_model_dir())
        what = demo.describe(args.model) or ("the random-weight demo model: untrained, so its text is gibberish "
                                             "and its routing near uniform (for comparison with the trained one)")
        print(f"expertcache demo: {what}", file=sys.stderr, flush=True)
    if args.device_memory is None and args.host_memory is None:
        args.device_memory = "25%"  # a budget smaller than the experts, so the cache has work
    return cmd_generate(args)


def add_sampling_args(p: argparse.ArgumentParser, prompt_default: str | None) -> None:
    p.add_argument("--prompt", default=prompt_default,
                   help="prompt text" + (f" (default: {prompt_default!r})" if prompt_default else
                                         "; without it: a chat in the terminal, or the prompt read from a pipe"))
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


# The architectures models/registry.py knows, with hub checkpoints of each layout (a test
# checks this list against the registry). Kept here so that --help does not import torch.
SUPPORTED = """supported checkpoints (config.json architectures, e.g. hub repos):
  Qwen3MoeForCausalLM      Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B
  Qwen2MoeForCausalLM      Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen2-57B-A14B
  MixtralForCausalLM       mistralai/Mixtral-8x7B-Instruct-v0.1
  OlmoeForCausalLM         allenai/OLMoE-1B-7B-0924
  DeepseekV2ForCausalLM    deepseek-ai/DeepSeek-V2-Lite
  DeepseekV3ForCausalLM    deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct (block fp8 as shipped)
  Glm4MoeForCausalLM       zai-org/GLM-4.5-Air, zai-org/GLM-4.5
  Glm4MoeLiteForCausalLM   zai-org/GLM-4.7-Flash
  GptOssForCausalLM        openai/gpt-oss-20b, openai/gpt-oss-120b (MXFP4 experts as shipped)
  Qwen3NextForCausalLM     Qwen/Qwen3-Next-80B-A3B-Instruct (hybrid: Gated DeltaNet + attention)
  Qwen3_5MoeForConditionalGeneration  Qwen/Qwen3.5-35B-A3B (its text model; hybrid)
  Qwen3_5MoeForCausalLM    a Qwen3.5-MoE text-only checkpoint (hybrid)"""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `expertcache generate: error: argument --top-p: ... (see --help)`, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as dist_version

    try:
        return dist_version("expertcache")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="expertcache", description=__doc__.splitlines()[0], epilog=SUPPORTED,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"expertcache {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streaming tokens")
    add_engine_args(g)
    add_sampling_args(g, None)
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="generate under an expert budget smaller than the experts (25%% in the "
                                    "fastest tier) and show the cache; default model: the built-in demo",
                       epilog=SUPPORTED, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(d)
    add_sampling_args(d, "def forward(self, x):")
    d.set_defaults(temperature=0.7, top_p=0.9, seed=0)  # the demo samples (reproducibly): greedy loops on a tiny model
    d.add_argument("--random", action="store_true",
                   help="use the untrained random-weight demo model (built once in ~/.cache/expertcache)")
    d.add_argument("--rebuild", action="store_true", help="with --random: rebuild that checkpoint")
    d.set_defaults(func=cmd_demo)
    from .chat_cli import add_chat_subcommand
    from .plan import add_plan_subcommand
    from .quant.cli import add_quantize_subcommand
    from .server.cli import add_serve_subcommand
    from .trace.cli import add_trace_subcommands

    for add in (add_chat_subcommand, add_serve_subcommand, add_trace_subcommands, add_plan_subcommand, add_quantize_subcommand):
        add(sub)
    return parser


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
    except Exception as e:  # noqa: BLE001 - the command line shows one line, never a traceback
        if debug:
            raise
        print(f"error: {error_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the subcommand
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    return run_command(args.func, args, debug)


if __name__ == "__main__":
    sys.exit(main())
