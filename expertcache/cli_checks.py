"""Command-line values checked before a weight byte is read: each failure is one ValueError naming the flag.

`check_sampling(args)` maps SamplingParams' validation onto the flags (--max-tokens, --temperature,
--top-p, --top-k, --seed); `check_prompt_fits(args, model_dir)` tokenizes the prompt with the
model's tokenizer (config.json and tokenizer files only) and compares prompt + --max-tokens with
--max-model-len (default min(max_position_embeddings, 4096), as the engine computes it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import ConfigError

_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
          "seed": "--seed"}


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags; a bad value is reported under its flag name."""
    from .engine.params import SamplingParams

    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=args.stop)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        flag = _FLAGS.get(field)
        if flag is None:
            raise
        raise ConfigError(f"{flag} {getattr(args, field)}: {str(e).split(' ', 1)[1]}") from None


def check_prompt_fits(args: argparse.Namespace, model_dir: str | Path, prompt_ids: list[int]) -> int:
    """Return the context length the engine will use; raise if prompt + --max-tokens does not fit."""
    from .engine.kv_cache import default_max_model_len
    from .models.registry import read_config

    _, cfg, _ = read_config(Path(model_dir))
    limit = args.max_model_len or default_max_model_len(cfg.max_position_embeddings)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ConfigError(f"--max-model-len {args.max_model_len}: must be >= 1")
    if len(prompt_ids) + args.max_tokens > limit:
        src = f"--max-model-len {args.max_model_len}" if args.max_model_len else f"the default context of {limit}"
        raise ConfigError(f"--prompt: {len(prompt_ids)} tokens + --max-tokens {args.max_tokens} exceed {src} "
                          f"tokens; shorten the prompt, lower --max-tokens or raise --max-model-len "
                          f"(the model allows {cfg.max_position_embeddings})")
    return limit
