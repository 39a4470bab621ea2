"""Limits on a request's fields that bound the engine's work per token, checked right after the body is
parsed (before tokenizing or compiling a grammar): each a 400 naming the field and the `serve` flag.

- `stop`: at most `max_stop_strings` strings (OpenAI: 4) of at most `max_stop_chars` characters;
- `logit_bias`: at most `max_logit_bias` entries (OpenAI: 300);
- fan-out: the sequences a request runs, prompts x samples (`n`, or `best_of`), at most the engine's
  `--max-num-seqs` (one batch): the count is what the per-key limit (limits.Lease) holds.
"""

from __future__ import annotations

from ..engine.params import ParamError, check_batch, stop_list
from .errors import ApiError
from .limits import Limits
from .protocol import CompletionRequest, engine_samples


def _stop(req, limits: Limits) -> None:
    try:
        stop = stop_list(req.stop)
    except ParamError as e:
        raise ApiError(f"'stop' {e.reason}", "stop") from None
    if len(stop) > limits.max_stop_strings:
        raise ApiError(
            f"'stop' has {len(stop)} strings; at most {limits.max_stop_strings} are accepted "
            "(--max-stop-strings)",
            "stop",
        )
    long = next((s for s in stop if len(s) > limits.max_stop_chars), None)
    if long is not None:
        raise ApiError(
            f"a 'stop' string has {len(long)} characters; at most {limits.max_stop_chars} are accepted "
            "(--max-stop-chars)",
            "stop",
        )


def _logit_bias(req, limits: Limits) -> None:
    n = len(req.logit_bias or {})
    if n > limits.max_logit_bias:
        raise ApiError(
            f"'logit_bias' has {n} entries; at most {limits.max_logit_bias} are accepted (--max-logit-bias)",
            "logit_bias",
        )


def sequences(req, max_num_seqs: int) -> tuple[int, str]:
    """-> (sequences the request runs, the parameter that sets it); 400 when more than one batch."""
    samples = engine_samples(req)  # n (or best_of); its range is SamplingParams'
    prompts = len(req.prompts()) if isinstance(req, CompletionRequest) else 1
    param = "prompt" if prompts > 1 else ("best_of" if getattr(req, "best_of", None) else "n")
    total = prompts * samples
    try:
        check_batch(total, max_num_seqs, param)
    except ParamError:
        what = f"{prompts} prompts x {samples} samples" if prompts > 1 else f"{samples} samples"
        raise ApiError(
            f"this request runs {total} sequences ({what}), more than the server's batch of "
            f"{max_num_seqs} sequences (--max-num-seqs)",
            param,
        ) from None
    return total, param


def check_fields(req, limits: Limits, max_num_seqs: int) -> tuple[int, str]:
    """All the field limits of one parsed request -> (sequences it runs, the parameter that sets it)."""
    _stop(req, limits)
    _logit_bias(req, limits)
    return sequences(req, max_num_seqs)
