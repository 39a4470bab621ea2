"""`expertcache chat [MODEL]` (and `generate` without --prompt): a conversation in the terminal.

On a terminal: a prompt `> `, each reply streamed as it is generated, then one stats line (this
turn's tokens and speeds, the cache so far) on stderr. The conversation goes through the model's
chat template; when it no longer fits the context, the oldest turns are dropped (the system prompt
stays) and a note says so. `/reset` forgets the conversation, `/exit` or Ctrl-D ends it.

With stdin not a terminal (a pipe or a file), all of stdin is one prompt and one reply is printed:
through the chat template for `chat` (and `generate --chat`), as raw text for `generate`.
"""

from __future__ import annotations

import argparse
import sys

HELP = "/reset forgets the conversation, /exit or Ctrl-D quits"


def _fit(tok, messages: list[dict], budget: int) -> tuple[list[int], int]:
    """Token ids of the conversation with the generation prompt, dropping the oldest turns to fit
    `budget` tokens; returns (ids, number of messages dropped)."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    dropped = 0
    while True:
        ids = tok.encode_chat(system + rest, add_generation_prompt=True)
        if len(ids) <= budget or len(rest) <= 1:
            return ids, dropped
        rest = rest[2:] if len(rest) > 2 else rest[1:]  # a user turn and its reply
        dropped += 2


def run_chat(args: argparse.Namespace, sp, template: bool = True) -> int:
    """A prompt piped on stdin: one answer; on a terminal: a conversation until /exit or EOF."""
    from .cli_common import engine_kwargs
    from .llm import LLM

    text = None
    if not sys.stdin.isatty():
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("stdin: no prompt (pipe a prompt in, or run on a terminal for a chat)")
    llm = LLM(**engine_kwargs(args))
    try:
        print("\n".join(llm.loaded_lines), file=sys.stderr)
        tok = llm.require_tokenizer()
        if text is not None:
            _answer_once(args, llm, tok, text, sp, template)
        else:
            _converse(args, llm, tok, sp)
    finally:
        llm.close()
    return 0


def _system(args) -> list[dict]:
    return [{"role": "system", "content": args.system}] if getattr(args, "system", None) else []


def _answer_once(args, llm, tok, text: str, sp, template: bool) -> None:
    """The piped prompt (as a user message under the chat template, or as plain text) answered once."""
    from .cli_checks import check_prompt_fits
    from .cli_common import stream_request

    msgs = _system(args) + [{"role": "user", "content": text.rstrip("\n")}]
    ids = tok.encode_chat(msgs) if template else tok.encode(text)
    check_prompt_fits(args, llm.model_dir, ids)
    print(stream_request(llm, ids, sp), file=sys.stderr)


def _converse(args, llm, tok, sp) -> None:
    """Read a line, answer it with the conversation so far (the oldest messages dropped to fit), repeat;
    /reset, /exit, /quit; Ctrl-C ends it."""
    messages = _system(args)
    budget = llm.max_model_len - sp.max_tokens
    print(
        f"chat with {getattr(args, 'model_spec', None) or args.model or 'the demo model'}; {HELP}",
        file=sys.stderr,
        flush=True,
    )
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                break
            cmd = line.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                messages = messages[:1] if messages and messages[0]["role"] == "system" else []
                print("(conversation cleared)", file=sys.stderr, flush=True)
            elif cmd.startswith("/"):
                print(f"unknown command {cmd}; {HELP}", file=sys.stderr, flush=True)
            elif cmd:
                messages = _turn(llm, tok, messages, line, sp, budget)
    except KeyboardInterrupt:
        print(file=sys.stderr)


def _turn(llm, tok, messages: list[dict], line: str, sp, budget: int) -> list[dict]:
    """One user message answered (streamed to stdout) -> the conversation with both, or unchanged when
    the message alone does not fit the context."""
    from .cli_common import stream_request

    messages = messages + [{"role": "user", "content": line}]
    ids, dropped = _fit(tok, messages, budget)
    if len(ids) > budget:
        print(
            f"(this message is {len(ids)} tokens; with --max-tokens {sp.max_tokens} it exceeds the "
            f"context of {llm.max_model_len}; not sent)",
            file=sys.stderr,
            flush=True,
        )
        return messages[:-1]
    if dropped:
        n_sys = 1 if messages[0]["role"] == "system" else 0
        messages = messages[:n_sys] + messages[n_sys + dropped :]
        print(f"(dropped the oldest {dropped} messages to fit the context)", file=sys.stderr, flush=True)
    reply: list[str] = []

    class _Tee:
        def write(self, s: str) -> None:
            reply.append(s)
            sys.stdout.write(s)

        def flush(self) -> None:
            sys.stdout.flush()

    stats = stream_request(llm, ids, sp, out=_Tee())
    messages.append({"role": "assistant", "content": "".join(reply).rstrip("\n")})
    print(stats, file=sys.stderr, flush=True)
    return messages


def cmd_chat(args: argparse.Namespace) -> int:
    from .cli_checks import sampling_params
    from .cli_common import model_dir_arg

    sp = sampling_params(args)
    model_dir_arg(args)
    return run_chat(args, sp, template=True)


def add_chat_subcommand(subparsers) -> argparse.ArgumentParser:
    from .cli_common import add_engine_args

    p = subparsers.add_parser(
        "chat",
        help="a conversation with the model in the terminal (chat template, "
        "streamed replies, a stats line per turn); reads one prompt from a pipe",
    )
    add_engine_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: 256)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default: 0.9)")
    p.add_argument(
        "--top-k", type=int, default=20, help="sample among the k most likely tokens (default: 20)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.set_defaults(func=cmd_chat)
    return p
