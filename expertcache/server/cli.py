"""`expertcache serve [MODEL_DIR] ...`: the OpenAI-compatible HTTP server.

Registered into the main CLI by `add_serve_subcommand(subparsers)`; `python -m expertcache.server`
runs the same command. The HTTP server binds first and answers /health (503 while loading);
the model loads in a background thread. Binds loopback unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .gate import LOOPBACK_BIND
from .limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_CEILING,
    MAX_STOP_CHARS,
    MAX_STOP_CHARS_CEILING,
    MAX_STOP_STRINGS,
    MAX_STOP_STRINGS_CEILING,
    RECORD_ROUTING_MAX_STEPS,
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from ..cli_common import add_engine_args

    add_engine_args(p)
    s = p.add_argument_group("server")
    for add in (_add_binding, _add_request_limits, _add_access_and_serving):  # in --help's order
        add(s)


def _add_binding(s) -> None:
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: "
        "$EXPERTCACHE_API_KEY); visible in `ps`: prefer --api-key-file or the variable",
    )
    s.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="read the API key from FILE, so it does not show in the process list; several lines "
        "= several accepted keys (each with its own --max-concurrent-per-key)",
    )


def _add_request_limits(s) -> None:
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body accepted, larger ones get 413 (default: 32 bytes per token of "
        "--max-model-len, at least 1 MiB)",
    )
    s.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=0,
        help="sequences in flight per API key (per client address without a key), a request counting "
        "its prompts x n; more get 429 (default: 0 = no limit)",
    )
    s.add_argument(
        "--max-stop-strings",
        type=int,
        default=MAX_STOP_STRINGS,
        help=f"'stop' strings per request, at most {MAX_STOP_STRINGS_CEILING} (default: "
        f"{MAX_STOP_STRINGS}, OpenAI's limit)",
    )
    s.add_argument(
        "--max-stop-chars",
        type=int,
        default=MAX_STOP_CHARS,
        help=f"characters per 'stop' string, at most {MAX_STOP_CHARS_CEILING} (default: {MAX_STOP_CHARS})",
    )
    s.add_argument(
        "--max-logit-bias",
        type=int,
        default=MAX_LOGIT_BIAS,
        help=f"'logit_bias' entries per request, at most {MAX_LOGIT_BIAS_CEILING} (default: "
        f"{MAX_LOGIT_BIAS}, OpenAI's limit)",
    )
    s.add_argument(
        "--record-routing-max-steps",
        type=int,
        default=RECORD_ROUTING_MAX_STEPS,
        help="with --record-routing: engine steps the trace keeps; recording then stops with a "
        f"warning (default: {RECORD_ROUTING_MAX_STEPS})",
    )


def _add_access_and_serving(s) -> None:
    s.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAME,...",
        help="comma-separated Host header names the server answers to, others get 400 (default: "
        "localhost, 127.0.0.1, ::1 when bound to loopback; required otherwise; '*' = any)",
    )
    s.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without the API key (a scraper without credentials)",
    )
    s.add_argument(
        "--api-docs",
        action="store_true",
        help="serve the API docs at /docs, /redoc, /openapi.json (behind the API key; the docs "
        "pages load their scripts from a CDN)",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="name clients pass as 'model' (default: the model argument, or 'expertcache-demo')",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step, prefill chunks included (default: 2048)",
    )
    s.add_argument(
        "--no-prefix-caching", action="store_true", help="turn off KV prefix reuse across requests"
    )
    s.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between status lines while busy; 0 = off (default: 10)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")


def api_key(args: argparse.Namespace) -> str | tuple[str, ...] | None:
    """--api-key, else --api-key-file's keys (one per line), else $EXPERTCACHE_API_KEY; ConfigError on
    a bad file."""
    from ..errors import ConfigError

    if args.api_key and args.api_key_file:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        keys = tuple(line.strip() for line in lines if line.strip())
        if not keys:
            raise ConfigError(f"--api-key-file {args.api_key_file}: the file is empty")
        return keys[0] if len(keys) == 1 else keys
    return args.api_key or os.environ.get("EXPERTCACHE_API_KEY") or None


def _names(value: str | None) -> list[str] | None:
    """--allowed-hosts 'a, b' -> ['a', 'b'] (None when not given)."""
    if value is None:
        return None
    return [n.strip() for n in value.split(",") if n.strip()]


def _server_config(args: argparse.Namespace):
    from ..cli_common import engine_kwargs
    from .app import ServerConfig
    from .gate import Access
    from .limits import Limits

    kw = engine_kwargs(args)
    kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.no_prefix_caching:
        kw["prefix_caching"] = False
    if args.model is None:
        name, aliases = "expertcache-demo", set()
    else:
        path = Path(args.model)
        name = getattr(args, "model_spec", None) or args.model
        aliases = {str(path), str(path.resolve()), path.resolve().name}
    if args.served_model_name:
        aliases.add(name)
        name = args.served_model_name
    return ServerConfig(
        model_name=name,
        llm_kwargs=kw,
        api_key=args.api_key,
        log_interval=args.log_interval,
        aliases=aliases - {name},
        save_expert_stats=args.save_expert_stats,
        limits=Limits(
            args.max_request_bytes,
            args.max_concurrent_per_key,
            args.max_stop_strings,
            args.max_stop_chars,
            args.max_logit_bias,
            args.record_routing_max_steps,
        ),
        access=Access.for_bind(
            args.host,
            _names(args.allowed_hosts),
            api_key=args.api_key,
            public_metrics=args.public_metrics,
            api_docs=args.api_docs,
        ),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("expertcache.server")
    from ..cli_common import resolve_model_arg

    resolve_model_arg(args)
    args.api_key = api_key(args)
    if args.host not in LOOPBACK_BIND and not args.api_key:
        log.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", args.host
        )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = _server_config(args)  # every flag checked before the model is touched
    from ..llm import run_torchrun_worker
    from ..parallel.worker import torchrun_rank

    if torchrun_rank():  # ranks 1..N-1 under torchrun: no HTTP server, mirror rank 0
        from ..cli_common import engine_kwargs

        return run_torchrun_worker(engine_kwargs(args))
    server: uvicorn.Server | None = None

    def stop(error: str) -> None:
        log.error("shutting down: the model failed to load (%s)", error)
        if server is not None:
            server.should_exit = True

    cfg.on_load_error = stop
    app = create_app(cfg)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=not args.no_access_log,
            timeout_graceful_shutdown=5,
        )
    )
    log.info(
        "serving %r on http://%s:%d (model loads in the background; see /health)",
        cfg.model_name,
        args.host,
        args.port,
    )
    server.run()
    return 2 if app.state.server.loader.state == "error" else 0  # the error was logged as one line


def add_serve_subcommand(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics)")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def main(argv: list[str] | None = None) -> int:
    from ..cli_common import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    parser = argparse.ArgumentParser(prog="python -m expertcache.server", description=__doc__.splitlines()[0])
    add_serve_args(parser)
    return run_command(cmd_serve, parser.parse_args([a for a in argv if a != "--debug"]), debug)
