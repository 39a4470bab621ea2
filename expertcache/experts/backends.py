"""MoE compute backends: who computes a pool's grouped expert FFN, by registry.

A backend kind (`Kind`) owns its capability check (`why_not(pool, device, options)`: None where it
runs, else why not) and its compute. `choose_backend(pool, device, options)` takes the first registered
kind whose check passes (or the one `options.backend` names: a ConfigError saying why where it cannot
run) and returns a `Backend`, whose `line` names it; the builder prints that line. moe_ffn asks for
its pool's backend once per pool and configuration (`backend_for`, cached by the pool's tensors).

| kind | runs where | computes |
|---|---|---|
| triton | CUDA (CPU: TRITON_INTERPRET=1); triton importable, reading the format | triton_moe.py, 2 launches |
| cpp | CPU, float32 activations; the C++ kernels loaded, reading the pool | kernels.moe, 1 call a layer |
| torch | anywhere | ffn.torch_moe: grouped GEMM, else a loop over the active slots |

At a fast-math prefill on the CPU, cpp and torch first send the experts of many tokens to torch's
bf16 matmul (experts/prefill.py) and compute the rest. A failure of an automatically chosen triton
(a compile error on a GPU it was never built for) falls back for that configuration only: one note
on stderr, then the configuration's next backend (cpp or torch) computes; an explicit choice raises.
The GGUF kernels register their own kind (`register`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .. import kernels
from ..errors import ConfigError
from .ffn import SWIGLU, ExpertFFN, torch_moe
from .prefill import prefill_moe

Pool = dict[str, torch.Tensor]
log = logging.getLogger("expertcache.experts")


@dataclass(frozen=True)
class MoEOptions:
    """What a pool is computed for: its QuantMethod (None: plain parts), the experts' layout, the
    activations' dtype and hidden size, and the backend asked for (None: the first registered kind whose
    check passes; a name: that kind, or a ConfigError saying why it cannot run). `fallback`: the kind
    asked for was an automatic choice (`--moe-kernel auto`), so where it cannot run, or fails, the best
    of the others computes instead. `exclude`: kinds not chosen automatically."""

    method: object = None
    ffn: ExpertFFN = SWIGLU
    dtype: torch.dtype = torch.float32
    hidden: int | None = None
    backend: str | None = None
    fallback: bool = False
    exclude: frozenset[str] = frozenset()

    @classmethod
    def for_ffn(cls, method, ffn: ExpertFFN, dtype: torch.dtype, hidden: int) -> MoEOptions:
        """The options of experts whose layout `ffn` carries the resolved `--moe-kernel` (with_moe_kernel):
        "triton" asks for triton (falling back where `auto` chose it: ffn.kernel_fallback); "torch" for
        the best of the others. The builder: choose_backend(pool, device, MoEOptions.for_ffn(...))."""
        if ffn.kernel == "triton":
            return cls(method, ffn, dtype, hidden, "triton", ffn.kernel_fallback)
        return cls(method, ffn, dtype, hidden, exclude=frozenset({"triton"}))

    @classmethod
    def of(cls, method, ffn: ExpertFFN, x: torch.Tensor) -> MoEOptions:
        """The options moe_ffn's arguments imply (x [T, H]: the activations)."""
        return cls.for_ffn(method, ffn, x.dtype, x.shape[1])

    def without(self, name: str) -> MoEOptions:
        """The automatic choice among the other kinds."""
        return replace(self, backend=None, fallback=False, exclude=self.exclude | {name})


# compute(x, slots, weights, pool, method, ffn, out, host) -> out (a new one where out is None)
Compute = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Kind:
    name: str
    summary: str
    why_not: Callable[[Pool, torch.device, MoEOptions], str | None]
    compute: Compute
    automatic: Callable[[torch.device], bool] = lambda device: True  # chosen without being asked for


KINDS: dict[str, Kind] = {}  # in order of preference


def register(kind: Kind, before: str | None = None) -> None:
    """Add a backend kind (ahead of `before` where given, else last)."""
    if kind.name in KINDS:
        raise ValueError(f"MoE backend {kind.name!r} is registered already")
    items = list(KINDS.items())
    at = next((i for i, (n, _) in enumerate(items) if n == before), len(items))
    items.insert(at, (kind.name, kind))
    KINDS.clear()
    KINDS.update(items)


@dataclass
class Backend:
    """A configuration's chosen backend (`line` names it). `rest`: the options of the automatic choice
    among the other kinds, where a failure of this one falls back (then one note, and that choice
    computes this configuration from then on); None: a failure raises."""

    kind: Kind
    line: str
    rest: MoEOptions | None = None
    failed: str | None = None
    next: Backend | None = field(default=None, repr=False)

    def __call__(self, x, slots, weights, pool, method, ffn, out, host) -> torch.Tensor:
        if self.next is None:
            try:
                return self.kind.compute(x, slots, weights, pool, method, ffn, out, host)
            except Exception as e:
                if self.rest is None or isinstance(e, torch.OutOfMemoryError):
                    raise
                self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self.next = choose_backend(pool, x.device, self.rest)
                print(
                    f"note: the {self.kind.summary} failed ({self.failed}); computing these experts with "
                    f"the {self.next.kind.summary} from now on (--moe-kernel chooses up front)",
                    file=sys.stderr,
                )
        return self.next(x, slots, weights, pool, method, ffn, out, host)


def choose_backend(pool: Pool, device: torch.device | str, options: MoEOptions) -> Backend:
    """The backend that computes `pool` on `device` for `options` (the builder calls it once per pool and
    prints `.line`); ConfigError where the backend asked for cannot run, saying why."""
    device = torch.device(device)
    if options.backend is not None:
        kind = KINDS.get(options.backend)
        if kind is None:
            raise ConfigError(f"MoE backend: one of {', '.join(KINDS)}, got {options.backend!r}")
        why = kind.why_not(pool, device, options)
        if why is None:
            rest = options.without(kind.name) if options.fallback else None
            return Backend(kind, _line(kind, device, options), rest)
        if not options.fallback:
            raise ConfigError(f"moe_kernel={options.backend!r}: {why}")
        return choose_backend(pool, device, options.without(kind.name))
    skipped = []
    for kind in KINDS.values():
        if kind.name in options.exclude or not kind.automatic(device):
            continue
        why = kind.why_not(pool, device, options)
        if why is None:
            return Backend(kind, _line(kind, device, options, skipped))
        skipped.append(f"{kind.name}: {why}")
    raise ConfigError(f"no MoE backend computes this pool on {device}: {'; '.join(skipped)}")


def _line(kind: Kind, device: torch.device, options: MoEOptions, skipped: list[str] | None = None) -> str:
    fmt = getattr(options.method, "name", None) or "plain"
    why = f" (not {'; not '.join(skipped)})" if skipped else ""
    return f"MoE compute: {kind.name}, the {kind.summary}, for {fmt} experts on {device.type}{why}"


# -- the lazy choice: once per pool and configuration, until the builder chooses -------------------------
_CHOSEN: dict[int, tuple] = {}  # id(the pool's first tensor) -> (weakref, {key: (method, ffn, Backend)})
_SHARED: dict[tuple, Backend] = {}  # configuration -> its backend, shared by its pools (one note a failure)


def backend_for(pool: Pool, x: torch.Tensor, method, ffn: ExpertFFN) -> Backend:
    """choose_backend for moe_ffn's arguments, once per pool (its tensor objects) and configuration (x's
    device, dtype and width, the method, the layout; the parts' dtypes, devices and per-slot shapes): the
    pools of one configuration share its backend."""
    first = next(iter(pool.values()))
    hit = _CHOSEN.get(id(first))
    if hit is None or hit[0]() is not first:
        k = id(first)
        hit = _CHOSEN[k] = (weakref.ref(first, lambda _, k=k, table=_CHOSEN: table.pop(k, None)), {})
    key = (x.get_device(), x.dtype, x.shape[1], id(method), id(ffn))  # cheap; the objects checked below
    entry = hit[1].get(key)
    if entry is not None and entry[0] is method and entry[1] is ffn:
        return entry[2]
    config = (
        x.device,
        x.dtype,
        x.shape[1],
        method,
        ffn,
        *((n, t.dtype, t.device, tuple(t.shape[1:])) for n, t in pool.items()),
    )
    backend = _SHARED.get(config)
    if backend is None:
        backend = _SHARED[config] = choose_backend(pool, x.device, MoEOptions.of(method, ffn, x))
        log.info("%s", backend.line)  # once per configuration (the builder prints its own choice's line)
    hit[1][key] = (method, ffn, backend)
    return backend


# -- the kinds -------------------------------------------------------------------------------------------
def _triton_why_not(pool: Pool, device: torch.device, options: MoEOptions) -> str | None:
    from ..kernels import triton_moe  # at first use: triton is optional and slow to import

    return triton_moe.unavailable_reason(device) or triton_moe.supported(options.method, pool)


def _triton(x, slots, weights, pool, method, ffn, out, host) -> torch.Tensor:
    from ..kernels import triton_moe  # looked up per call: tests count its calls

    if host or slots.device != x.device:  # the host ids' slots: aligned on the host, sent in one copy
        num_slots = next(iter(pool.values())).shape[0]
        al = triton_moe.alignment_to(triton_moe.host_alignment(slots, num_slots), x.device)
        return triton_moe.fused_moe(x, None, weights, pool, method, ffn, out=out, alignment=al)
    return triton_moe.fused_moe(x, slots, weights, pool, method, ffn, out=out)


def _prefill_split(x, slots, weights, pool, method, ffn, out, host):
    """At a fast-math prefill on the CPU, the experts of many tokens on the bf16 matmul first ->
    (out, the slots left, host)."""
    if host or slots.is_cpu:
        split = prefill_moe(x, slots, weights, pool, method, ffn, out)
        if split is not None:
            return split[0], split[1], True
    return out, slots, host


def _cpp_why_not(pool: Pool, device: torch.device, options: MoEOptions) -> str | None:
    if kernels.backend() != "cpp":
        return f"the C++ kernels are not in use ({kernels.why()})"
    if device.type != "cpu" or options.dtype != torch.float32:
        return f"they compute float32 activations on the CPU, not {options.dtype} on {device.type}"
    if options.hidden is None or kernels.moe_args(pool, options.method, options.hidden, options.ffn) is None:
        return "they do not read this pool (its format, layout or activation, or its device)"
    return None


def _cpp(x, slots, weights, pool, method, ffn, out, host) -> torch.Tensor:
    out, slots, host = _prefill_split(x, slots, weights, pool, method, ffn, out, host)
    if out is None:  # the kernel starts from a zeroed output of its own (no torch call per layer)
        got = kernels.moe_out(x, slots, weights, pool, method, ffn)
        if got is not None:
            return got
        out = torch.zeros_like(x)
    elif kernels.moe(x, slots, weights, pool, method, out, ffn):
        return out
    return torch_moe(x, slots, weights, pool, method, out, ffn, host)  # an `out` the kernel does not write


def _torch(x, slots, weights, pool, method, ffn, out, host) -> torch.Tensor:
    out, slots, host = _prefill_split(x, slots, weights, pool, method, ffn, out, host)
    return torch_moe(x, slots, weights, pool, method, torch.zeros_like(x) if out is None else out, ffn, host)


register(
    Kind(
        "triton",
        "fused Triton MoE kernel",
        _triton_why_not,
        _triton,
        automatic=lambda device: device.type == "cuda",
    )
)
register(Kind("cpp", "C++ CPU kernels", _cpp_why_not, _cpp))
register(Kind("torch", "torch code", lambda pool, device, options: None, _torch))
