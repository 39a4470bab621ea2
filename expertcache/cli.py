"""The `expertcache` command: generate, demo, serve, plan, trace, quantize.

Subcommands living in other packages register through their `add_*_subcommand(subparsers)`;
the heavy work (torch, the model) is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import sys

from .cli_common import add_engine_args, engine_kwargs, model_dir_arg, run_command, stream_request


def cmd_generate(args: argparse.Namespace) -> int:
    from .cli_checks import check_prompt_fits, sampling_params
    from .llm import run_torchrun_worker
    from .parallel.worker import torchrun_rank

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
    ids = (
        tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    )
    check_prompt_fits(args, model_dir, ids)  # all before a weight byte is read
    llm = LLM(**engine_kwargs(args))
    print(
        "\n".join(llm.loaded_lines), file=sys.stderr
    )  # KV cache, cpu math, ... (the expert plan came before the load)
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
        what = demo.describe(args.model) or (
            "the random-weight demo model: untrained, so its text is gibberish "
            "and its routing near uniform (for comparison with the trained one)"
        )
        print(f"expertcache demo: {what}", file=sys.stderr, flush=True)
    if args.device_memory is None and args.host_memory is None:
        args.device_memory = "25%"  # a budget smaller than the experts, so the cache has work
    return cmd_generate(args)


def add_sampling_args(p: argparse.ArgumentParser, prompt_default: str | None) -> None:
    p.add_argument(
        "--prompt",
        default=prompt_default,
        help="prompt text"
        + (
            f" (default: {prompt_default!r})"
            if prompt_default
            else "; without it: a chat in the terminal, or the prompt read from a pipe"
        ),
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message with the chat template"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    p.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0 = off)"
    )
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
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("expertcache")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="expertcache",
        description=__doc__.splitlines()[0],
        epilog=SUPPORTED,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"expertcache {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streaming tokens")
    add_engine_args(g)
    add_sampling_args(g, None)
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser(
        "demo",
        help="generate under an expert budget smaller than the experts (25%% in the "
        "fastest tier) and show the cache; default model: the built-in demo",
        epilog=SUPPORTED,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(d)
    add_sampling_args(d, "def forward(self, x):")
    d.set_defaults(
        temperature=0.7, top_p=0.9, seed=0
    )  # the demo samples (reproducibly): greedy loops on a tiny model
    d.add_argument(
        "--random",
        action="store_true",
        help="use the untrained random-weight demo model (built once in ~/.cache/expertcache)",
    )
    d.add_argument("--rebuild", action="store_true", help="with --random: rebuild that checkpoint")
    d.set_defaults(func=cmd_demo)
    from .chat_cli import add_chat_subcommand
    from .plan import add_plan_subcommand
    from .quantize.cli import add_quantize_subcommand
    from .server.cli import add_serve_subcommand
    from .trace.cli import add_trace_subcommands

    for add in (
        add_chat_subcommand,
        add_serve_subcommand,
        add_trace_subcommands,
        add_plan_subcommand,
        add_quantize_subcommand,
    ):
        add(sub)
    return parser


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
