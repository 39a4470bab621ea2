"""CacheConfig: every expert-cache option, validated completely before a weight byte is read.

Built from `LLM(...)` keywords (`CacheConfig.from_options`) or the CLI flags (cli.engine_kwargs
passes the same keywords). Invariants once constructed:
- budgets parse (parse_budget: bytes like "512MiB", a share "25%" in (0, 100], "auto", or None) and are >= 0;
- `policy` is an online policy of the registry (None = the default), `prefetch` a mode,
  `cpu_compute` one of auto | always | never, `prefill_admit_tokens` >= 0, `load_stats` a file,
  `moe_kernel` one of auto | triton | torch (whether triton runs on the device: compute.with_moe_kernel);
- options that only mean something to the tiered cache are refused when every expert is resident
  (no budget given), never silently dropped; `resident_notes` names those that a budget large
  enough for every expert makes moot (printed with the memory plan).
Ablation switches (features turned off to measure them, and the slot-bytes check used by tests)
live in `CacheAblation`, not on the hot path's signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import ConfigError
from ..units import parse_bytes
from .policy import DEFAULT_POLICY, ONLINE
from .prefetch import PREFETCH_MODES

CPU_COMPUTE = ("auto", "always", "never")
MOE_KERNELS = (
    "auto",
    "triton",
    "torch",
)  # auto: triton on CUDA where it runs, else torch (experts/compute.py)


@dataclass(frozen=True)
class CacheAblation:
    """Switches that turn a feature off (benchmarks, tests). Defaults are the product.

    overlap_io     a step's disk reads in parallel with its hits (False: one synchronous read per miss)
    prefetch_gate  PrefetchGate threshold (None: never gate)
    exclusive      RAM tiers hold disjoint experts (None: where the formats allow it; False: inclusive)
    o_direct       disk reads bypass the page cache (False: buffered reads)
    verify         every slot fill compared with the checkpoint's bytes (slow; tests)
    """

    overlap_io: bool = True
    prefetch_gate: float | None = 0.0
    exclusive: bool | None = None
    o_direct: bool = True
    verify: bool = False

    def __post_init__(self):
        for name in ("overlap_io", "o_direct", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        if self.exclusive is not None and not isinstance(self.exclusive, bool):
            raise ConfigError(f"exclusive: must be True, False or None, got {self.exclusive!r}")
        g = self.prefetch_gate
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not -1.0 <= g <= 1.0):
            raise ConfigError(f"prefetch_gate: a score threshold in [-1, 1] or None, got {g!r}")


@dataclass(frozen=True)
class Budget:
    """A byte budget as written: "auto", a share of some total ("25%"), or a size ("512MiB", 2**30).

    The one parser of budgets (device_memory, host_memory, kv_cache_memory): build/plan.py resolves
    them, CacheConfig checks them."""

    kind: str  # "auto" | "share" | "bytes"
    amount: float = 0  # share: the percentage in (0, 100]; bytes: the size

    @property
    def auto(self) -> bool:
        return self.kind == "auto"

    @property
    def share(self) -> bool:
        return self.kind == "share"

    def bytes(self, total: int, auto: int) -> int:
        """The budget in bytes: a share of `total`, `auto` for "auto", else the size."""
        if self.kind == "share":
            return int(total * self.amount / 100)
        return auto if self.kind == "auto" else int(self.amount)


def parse_budget(value, name: str) -> Budget | None:
    """None -> None; "auto" -> Budget("auto"); "N%" with N in (0, 100]; a size -> Budget("bytes", n).
    Raises ConfigError naming `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name}: expected a size (512MiB), a share (25%) or 'auto', got {value!r}")
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise ConfigError(f"{name}: cannot parse {value!r} (examples: 25%, 512MiB, auto)") from None
        if not 0 < pct <= 100:
            raise ConfigError(f"{name}: a percentage must lie in (0, 100], got {value!r}")
        return Budget("share", pct)
    try:
        n = parse_bytes(value, name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Budget("auto") if n is None else Budget("bytes", n)


@dataclass(frozen=True)
class CacheConfig:
    device_memory: str | int | None = None  # fastest tier budget; None with host_memory None = all resident
    host_memory: str | int | None = None
    policy: str | None = None  # None: DEFAULT_POLICY
    prefetch: str = "auto"
    cpu_compute: str = "auto"
    load_stats: str | None = None
    prefill_admit_tokens: int = 64
    low_memory: bool = False
    cost_profile: str | None = None  # the per-miss choice's hardware profile (CUDA); None: the default
    moe_kernel: str = "auto"  # what computes the experts in device memory (resident or cached)
    ablation: CacheAblation = field(default_factory=CacheAblation)

    def __post_init__(self):
        parse_budget(self.device_memory, "device_memory")
        parse_budget(self.host_memory, "host_memory")
        if self.policy is not None and self.policy not in ONLINE:
            extra = " ('min' needs future knowledge: trace replay only)" if self.policy == "min" else ""
            raise ConfigError(
                f"cache_policy: unknown {self.policy!r}{extra}; choose one of {', '.join(ONLINE)}"
            )
        if self.prefetch not in PREFETCH_MODES:
            raise ConfigError(
                f"prefetch: must be one of {', '.join(PREFETCH_MODES)} or a bool, got {self.prefetch!r}"
            )
        if self.cpu_compute not in CPU_COMPUTE:
            raise ConfigError(f"cpu_compute: must be auto, always or never, got {self.cpu_compute!r}")
        if self.moe_kernel not in MOE_KERNELS:
            raise ConfigError(f"moe_kernel: must be one of {', '.join(MOE_KERNELS)}, got {self.moe_kernel!r}")
        n = self.prefill_admit_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"prefill_admit_tokens: an integer >= 0, got {n!r}")
        if not isinstance(self.low_memory, bool):
            raise ConfigError(f"low_memory: must be True or False, got {self.low_memory!r}")
        if self.cost_profile is not None and self.cost_profile != "this-cpu":
            from ..cost.profiles import get_profile

            try:
                get_profile(self.cost_profile)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cost_profile: {e}") from None
        if self.load_stats is not None and not Path(self.load_stats).is_file():
            raise ConfigError(f"load_stats: {self.load_stats} is not a file")
        if not self.tiered:
            moot = self.cache_only_options()
            if moot:
                raise ConfigError(
                    f"{', '.join(moot)}: only the expert cache uses "
                    f"{'this option' if len(moot) == 1 else 'these options'}, and without "
                    f"device_memory or host_memory every expert is resident; give a budget "
                    f"(e.g. device_memory='25%') or leave {'it' if len(moot) == 1 else 'them'} out"
                )

    @property
    def tiered(self) -> bool:
        """A budget was given (or low_memory, which sizes 'auto' budgets): the tiered cache is built."""
        return self.device_memory is not None or self.host_memory is not None or self.low_memory

    @property
    def policy_name(self) -> str:
        return self.policy or DEFAULT_POLICY

    def cache_only_options(self) -> list[str]:
        """The options set away from their defaults that only the tiered cache uses (keyword names)."""
        out = [
            k
            for k, default in (
                ("cache_policy", None),
                ("prefetch", "auto"),
                ("cpu_compute", "auto"),
                ("load_stats", None),
                ("prefill_admit_tokens", 64),
                ("cost_profile", None),
            )
            if getattr(self, KEYWORDS.get(k, k)) != default
        ]
        out += [f.name for f in fields(CacheAblation) if getattr(self.ablation, f.name) != f.default]
        return out

    @classmethod
    def from_options(cls, **options) -> CacheConfig:
        """From LLM(...) keywords: device_memory, host_memory, cache_policy, prefetch (a mode or a bool),
        cpu_compute, load_stats, prefill_admit_tokens, low_memory, cost_profile, moe_kernel and the CacheAblation
        switches."""
        abl = {f.name for f in fields(CacheAblation)}
        known = set(KEYWORDS) | {f.name for f in fields(cls)} - {"policy", "ablation"} | abl
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r}; expert cache options: {', '.join(sorted(known))}"
            )
        if "prefetch" in options:
            p = options["prefetch"]
            options["prefetch"] = (
                {True: "device", False: "off", None: "auto"}.get(p, p)
                if isinstance(p, (bool, type(None)))
                else p
            )
        kw = {KEYWORDS.get(k, k): v for k, v in options.items() if k not in abl}
        return cls(**kw, ablation=CacheAblation(**{k: v for k, v in options.items() if k in abl}))


KEYWORDS = {"cache_policy": "policy"}  # LLM keyword -> field
