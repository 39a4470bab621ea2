"""Command-line values checked before a weight byte is read: each failure is one ConfigError naming the flag.

`sampling_params(args)` builds SamplingParams from the flags (--max-tokens, --temperature, --top-p,
--top-k, --seed, --stop) and reports its ParamError under the flag of the field it names;
`check_prompt_fits(args, model_dir, prompt_ids)` compares prompt + --max-tokens with --max-model-len
(default min(max_position_embeddings, 4096), as the engine computes it) through the engine's own
`check_context`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import ConfigError

FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "seed": "--seed",
    "stop": "--stop",
}  # SamplingParams field -> the flag that sets it


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags; a bad value is reported under its flag name."""
    from .engine.params import ParamError, SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
    except ParamError as e:
        flag = FLAGS[e.field]  # every field set above has its flag
        value = getattr(args, e.field)
        shown = " ".join(f"{flag} {v!r}" for v in value) if isinstance(value, list) else f"{flag} {value}"
        raise ConfigError(f"{shown}: {e.reason}") from None


def check_prompt_fits(args: argparse.Namespace, model_dir: str | Path, prompt_ids: list[int]) -> int:
    """Return the context length the engine will use; raise if prompt + --max-tokens does not fit."""
    from .engine.kv_cache import default_max_model_len
    from .engine.params import ParamError, check_context
    from .models.registry import read_config

    _, cfg, _ = read_config(Path(model_dir))
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ConfigError(f"--max-model-len {args.max_model_len}: must be >= 1")
    limit = args.max_model_len or default_max_model_len(cfg.max_position_embeddings)
    try:
        check_context(len(prompt_ids), args.max_tokens, limit)
    except ParamError:
        src = (
            f"--max-model-len {args.max_model_len}"
            if args.max_model_len
            else f"the default context of {limit}"
        )
        raise ConfigError(
            f"--prompt: {len(prompt_ids)} tokens + --max-tokens {args.max_tokens} exceed {src} "
            f"tokens; shorten the prompt, lower --max-tokens or raise --max-model-len "
            f"(the model allows {cfg.max_position_embeddings})"
        ) from None
    return limit
