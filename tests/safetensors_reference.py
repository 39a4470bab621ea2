"""Each routed expert's stored parts read by tensor name with safetensors' own loader (safe_open),
the reference for the "slot bytes = checkpoint bytes" checks.

The engine fills its slots through ExpertSource.ranges() (byte ranges from the headers) and its own
`check(contents=True)` / `verify=True` compare them with ExpertSource.read, which reads the same
ranges: a wrong stride, part order or slice would pass. `independent_slot_checks(monkeypatch)` makes
those checks compare against this module instead: tensors found by their checkpoint names, sliced
by expert along the first dimension where the checkpoint fuses the experts.

Part names (the engine's): plain experts "gate_up" (gate rows then up rows, or the fused tensor as
stored), "down", and with expert biases "gate_up_bias", "down_bias"; quantized experts one part per
stored tensor, "PROJ.SUFFIX" as the quantization method lays them out (gate/up/down, or gate_up/down
where the checkpoint fuses them).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from expertcache.models.registry import read_config


class CheckpointExperts:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.family, self.cfg, _ = read_config(self.model_dir)
        self.where: dict[str, Path] = {}  # checkpoint tensor name -> file
        for f in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                self.where.update(dict.fromkeys(h.keys(), f))

    def _name(self, name: str) -> str:
        """The checkpoint's own name of an engine name (a nested checkpoint keeps `model.language_model.`)."""
        if name in self.where:
            return name
        hits = [k for k in self.where if k.endswith("." + name.removeprefix("model."))]
        if len(hits) != 1:
            raise KeyError(f"{name} not in {self.model_dir} ({len(hits)} candidates)")
        return hits[0]

    def has(self, name: str) -> bool:
        try:
            self._name(name)
            return True
        except KeyError:
            return False

    def get(self, name: str) -> torch.Tensor:
        name = self._name(name)
        with safe_open(str(self.where[name]), "pt") as h:
            return h.get_tensor(name)

    def prefix(self, layer: int) -> str:
        names = self.family.names
        for p in names.moe_prefixes:
            if self.has(f"model.layers.{layer}.{p}.{names.router}.weight"):
                return f"model.layers.{layer}.{p}"
        raise KeyError(f"no router of layer {layer} in {self.model_dir}")

    def read(self, layer: int, e: int, part_names, aliases: dict | None = None) -> dict[str, torch.Tensor]:
        """aliases: the quantization method's stored suffix -> the checkpoint's alternative suffix."""
        pre, names = self.prefix(layer), self.family.names
        g, u, d = names.expert_projs
        out = {}
        for part in part_names:
            if part in ("gate_up_bias", "down_bias"):
                out[part] = self.get(f"{pre}.experts.{part.removesuffix('_bias')}_proj_bias")[e]
            elif part in ("gate_up", "down"):
                fused = f"{pre}.experts.{part}_proj"
                if self.has(fused):
                    out[part] = self.get(fused)[e]
                elif part == "gate_up":
                    out[part] = torch.cat(
                        [self.get(f"{pre}.experts.{e}.{g}.weight"), self.get(f"{pre}.experts.{e}.{u}.weight")]
                    )
                else:
                    out[part] = self.get(f"{pre}.experts.{e}.{d}.weight")
            else:  # a quantized part "PROJ.SUFFIX"
                proj, suffix = part.split(".", 1)
                fused = f"{pre}.experts.{proj}_proj{suffix.removeprefix('weight')}"
                if self.has(fused):
                    out[part] = self.get(fused)[e]
                else:
                    base = f"{pre}.experts.{e}." + {"gate": g, "up": u, "down": d}[proj]
                    if not self.has(f"{base}.{suffix}") and suffix in (aliases or {}):
                        suffix = aliases[suffix]
                    out[part] = self.get(f"{base}.{suffix}")
        return out


@lru_cache(maxsize=16)
def checkpoint_experts(model_dir: str) -> CheckpointExperts:
    return CheckpointExperts(Path(model_dir))


def same_bytes(slot: torch.Tensor, ref: torch.Tensor) -> bool:
    """A slot holds the stored bytes (same dtype) or the stored values converted to its dtype."""
    slot = slot.detach().cpu()
    if slot.dtype == ref.dtype:
        return slot.shape == ref.reshape(slot.shape).shape and torch.equal(
            slot.reshape(-1).view(torch.uint8), ref.reshape(-1).contiguous().view(torch.uint8)
        )
    if ref.dtype == torch.uint8 and slot.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.equal(slot.reshape(-1).view(torch.uint8), ref.reshape(-1))
    return torch.equal(slot, ref.reshape(slot.shape).to(slot.dtype))


def independent_slot_checks(monkeypatch) -> None:
    """From now on, TieredExperts' slot-content checks (verify=True, check(contents=True)) compare every
    slot with CheckpointExperts instead of the engine's own byte-range reader."""
    from expertcache.experts.manager import TieredExperts

    def verify(self, layer, e, dst):
        method = self.source.method
        ref = checkpoint_experts(str(self.source.index.model_dir)).read(
            layer, e, list(dst), method.aliases if method is not None else None
        )
        for n, t in dst.items():
            if not same_bytes(t, ref[n]):
                raise AssertionError(
                    f"slot bytes of layer {layer} expert {e} part {n} differ from the "
                    "checkpoint (read with safetensors)"
                )
        self.independent_checks = getattr(self, "independent_checks", 0) + 1

    monkeypatch.setattr(TieredExperts, "_verify", verify)
