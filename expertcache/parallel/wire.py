"""What expert-parallel ranks send each other: plain data and tensors as bytes, never pickles.

A message is encoded into one uint8 tensor: an 8-byte header length, a JSON header, then the raw
bytes of every tensor the message holds. Decoding runs `json.loads` and rebuilds tensors from
(dtype, shape, offset) entries and the few named types in `TYPES`: a peer that sends garbage gets
an `ExpertParallelError`, never code run in the receiver (pickle would run any callable it names).

Encodable: None, bool, int, float, str, list, tuple, dict (any encodable keys), torch.Tensor
(any device; decoded on the CPU), and the registered NamedTuples / dataclasses of `TYPES`; numpy
scalars and arrays (counters) arrive as Python numbers and lists.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import torch

from ..errors import ExpertCacheError
from ..layers.attention import AttnBatch
from .placement import Placement

TYPES = {"AttnBatch": AttnBatch, "Placement": Placement}  # the only classes a message may hold
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


# The largest message a rank accepts (and sends), checked before the receiver allocates for it: a step's
# hidden states are T x H x 4 bytes (8192 tokens x hidden 7168: 235 MB), far below it.
MAX_MESSAGE_BYTES = 1 << 30


class WireError(ExpertCacheError, ValueError):
    """A message that is not a well-formed expert-parallel message."""


def check_size(n: int) -> int:
    """n, the announced byte length of a message, if a message may have it; else WireError (before any
    buffer of that size is allocated)."""
    if not 8 <= n <= MAX_MESSAGE_BYTES:
        raise WireError(
            f"message of {n} bytes announced; a message holds 8 to {MAX_MESSAGE_BYTES} bytes "
            "(parallel/wire.py MAX_MESSAGE_BYTES)"
        )
    return n


def encode(obj) -> torch.Tensor:
    """obj -> uint8 tensor [8 + header + tensor bytes] on the CPU."""
    tensors: list[torch.Tensor] = []
    header = json.dumps(_pack(obj, tensors), separators=(",", ":")).encode()
    parts = [
        torch.tensor(list(len(header).to_bytes(8, "little")), dtype=torch.uint8),
        torch.frombuffer(bytearray(header), dtype=torch.uint8),
    ]
    parts += [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    check_size(sum(p.numel() for p in parts))
    return torch.cat(parts)


def decode(buf: torch.Tensor):
    """uint8 tensor from `encode` -> obj (tensors on the CPU). Raises WireError on anything else."""
    raw = buf.detach().cpu().contiguous().numpy().tobytes()
    if len(raw) < 8:
        raise WireError(f"message of {len(raw)} bytes, shorter than its header length")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise WireError(f"message header of {n} bytes in a message of {len(raw)} bytes")
    try:
        tree = json.loads(raw[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"message header is not JSON: {e}") from None
    except RecursionError:
        raise WireError(f"message header of {n} bytes nests deeper than Python can parse") from None
    try:
        return _unpack(tree, memoryview(raw)[8 + n :])
    except RecursionError:
        raise WireError(f"message header of {n} bytes nests deeper than a message may") from None


def _pack(x, tensors: list):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        offset = sum(t.numel() * t.element_size() for t in tensors[:-1])
        return {"$tensor": [str(x.dtype).removeprefix("torch."), list(x.shape), offset]}
    name = type(x).__name__
    if TYPES.get(name) is type(x):
        fields = (
            x._asdict()
            if isinstance(x, tuple)
            else {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
        )
        return {"$type": name, "fields": _pack(fields, tensors)}
    if isinstance(x, (list, tuple)):
        items = [_pack(v, tensors) for v in x]
        return {"$tuple": items} if isinstance(x, tuple) else items
    if isinstance(x, dict):
        return {"$dict": [[_pack(k, tensors), _pack(v, tensors)] for k, v in x.items()]}
    raise WireError(f"cannot send a {name} between expert-parallel ranks")


def _unpack(x, data: memoryview):
    if isinstance(x, list):
        return [_unpack(v, data) for v in x]
    if not isinstance(x, dict):
        return x
    try:
        if "$tensor" in x:
            dtype_name, shape, offset = x["$tensor"]
            dtype = _DTYPES[dtype_name]
            shape = [int(s) for s in shape]
            if any(s < 0 for s in shape):
                raise WireError(f"tensor shape {shape} has a negative size")
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()  # exact: no int64 wrap
            if not 0 <= int(offset) <= len(data) - nbytes:
                raise WireError(f"tensor of {nbytes} bytes at {offset} outside the message's {len(data)}")
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            flat = torch.frombuffer(bytearray(data[offset : offset + nbytes]), dtype=torch.uint8)
            return flat.view(dtype).reshape(shape)
        if "$tuple" in x:
            return tuple(_unpack(v, data) for v in x["$tuple"])
        if "$dict" in x:
            return {_hashable(_unpack(k, data)): _unpack(v, data) for k, v in x["$dict"]}
        if "$type" in x:
            cls = TYPES[x["$type"]]
            return cls(**_unpack(x["fields"], data))
    except WireError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise WireError(f"malformed message entry {str(x)[:80]}: {e!r}") from None
    raise WireError(f"malformed message entry {str(x)[:80]}")


def _hashable(k):
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k
