"""RoutingTrace: which experts each token row was routed to, per MoE layer.

Arrays (N token rows, L MoE layers, K = top_k):
- experts  int32 [N, L, K]   expert ids in [0, num_experts)
- weights  float32 [N, L, K] router weights, optional
- seq      int32 [N]         sequence id of the row
- token    int32 [N]         token position inside its sequence
- phase    int8 [N]          0 prefill, 1 decode
- step     int64 [N]         forward-step index; rows of one batch step share it.
                             Non-decreasing along rows (replay relies on it: time
                             for the cache policies is the step, and experts of
                             one step are pinned together).
- lookahead int32 [N, L, K]  optional: experts of layer l predicted from layer
                             l-1's hidden state; row l=0 is all -1.

Metadata: model (str), num_experts, top_k, layer_ids (the model's layer index
of each MoE layer, len L), expert_bytes (bytes of one expert's weights).

On disk (`save`/`load`): one compressed numpy .npz (np.savez_compressed) with
the arrays above under their names (optional ones absent when None) plus
`meta`, a 0-d unicode array holding a JSON object
{"format": "expertcache-trace", "version": 1, "model", "num_experts",
"top_k", "layer_ids", "expert_bytes"}.

JSONL (`to_jsonl`/`from_jsonl`): one object per (sequence, layer, token):
{"seq": int, "layer": int, "token": int, "experts": [int]*K,
 "weights": [float]*K (optional), "phase": "prefill"|"decode" (optional,
 default "decode"), "step": int (optional)}. "layer" is the model layer id.
Rows are grouped by (seq, token); every group must cover every layer. When
"step" is absent rows get steps in order of first appearance of (seq, token),
one row per step.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError

PHASES = {"prefill": 0, "decode": 1}


@dataclass
class RoutingTrace:
    experts: np.ndarray
    num_experts: int
    seq: np.ndarray | None = None
    token: np.ndarray | None = None
    phase: np.ndarray | None = None
    step: np.ndarray | None = None
    weights: np.ndarray | None = None
    lookahead: np.ndarray | None = None
    model: str = ""
    layer_ids: list[int] = field(default_factory=list)
    expert_bytes: int = 0

    def __post_init__(self):
        self.experts = np.asarray(self.experts, dtype=np.int32)
        if self.experts.ndim != 3:
            raise ValueError(f"experts: expected shape [N, L, K], got {self.experts.shape}")
        n, nl, _ = self.experts.shape
        if self.seq is None:
            self.seq = np.zeros(n, np.int32)
        if self.token is None:
            self.token = np.arange(n, dtype=np.int32)
        if self.phase is None:
            self.phase = np.ones(n, np.int8)
        if self.step is None:
            self.step = np.arange(n, dtype=np.int64)
        self.seq = np.asarray(self.seq, np.int32)
        self.token = np.asarray(self.token, np.int32)
        self.phase = np.asarray(self.phase, np.int8)
        self.step = np.asarray(self.step, np.int64)
        if not self.layer_ids:
            self.layer_ids = list(range(nl))
        self.layer_ids = [int(x) for x in self.layer_ids]
        if self.weights is not None:
            self.weights = np.asarray(self.weights, np.float32)
        if self.lookahead is not None:
            self.lookahead = np.asarray(self.lookahead, np.int32)
        self.validate()

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    def __len__(self) -> int:
        return self.experts.shape[0]

    def validate(self, num_layers: int | None = None) -> None:
        """Raise ValueError naming the field that breaks an invariant.
        `num_layers`: the MoE layer count of the model the trace must match."""
        n, nl, _ = self.experts.shape
        if self.num_experts <= 0:
            raise ValueError(f"num_experts: must be positive, got {self.num_experts}")
        if num_layers is not None and nl != num_layers:
            raise ValueError(f"experts: trace has {nl} layers, model has {num_layers}")
        if len(self.layer_ids) != nl:
            raise ValueError(f"layer_ids: {len(self.layer_ids)} ids for {nl} layers")
        if n and (self.experts.min() < 0 or self.experts.max() >= self.num_experts):
            raise ValueError(
                f"experts: ids must lie in [0, {self.num_experts}), "
                f"got range [{self.experts.min()}, {self.experts.max()}]"
            )
        for name in ("seq", "token", "phase", "step"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name}: expected shape ({n},), got {getattr(self, name).shape}")
        if n > 1 and np.any(np.diff(self.step) < 0):
            raise ValueError("step: must be non-decreasing along rows")
        if not np.isin(self.phase, (0, 1)).all():
            raise ValueError("phase: must be 0 (prefill) or 1 (decode)")
        for name in ("weights", "lookahead"):
            a = getattr(self, name)
            if a is not None and a.shape != self.experts.shape:
                raise ValueError(f"{name}: expected shape {self.experts.shape}, got {a.shape}")
        if self.lookahead is not None and n:
            la = self.lookahead
            if la.min() < -1 or la.max() >= self.num_experts:
                raise ValueError(f"lookahead: ids must lie in [-1, {self.num_experts})")

    # ---- npz -----------------------------------------------------------------
    def meta(self) -> dict:
        return {
            "format": "expertcache-trace",
            "version": 1,
            "model": self.model,
            "num_experts": int(self.num_experts),
            "top_k": int(self.top_k),
            "layer_ids": self.layer_ids,
            "expert_bytes": int(self.expert_bytes),
        }

    def save(self, path: str | Path) -> None:
        arrays = {
            k: getattr(self, k)
            for k in ("experts", "seq", "token", "phase", "step", "weights", "lookahead")
            if getattr(self, k) is not None
        }
        with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
            np.savez_compressed(f, meta=np.array(json.dumps(self.meta())), **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "RoutingTrace":
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z or "experts" not in z:
                raise ValueError(f"{path}: not an expertcache trace (needs 'meta' and 'experts')")
            meta = json.loads(str(z["meta"]))
            arrs = {k: z[k] for k in ("seq", "token", "phase", "step", "weights", "lookahead") if k in z}
            experts = z["experts"]
        for key in ("num_experts", "top_k"):
            if key not in meta:
                raise ValueError(f"{path}: meta field {key!r} missing")
        if experts.ndim == 3 and experts.shape[2] != meta["top_k"]:
            raise ValueError(f"top_k: meta says {meta['top_k']}, experts has {experts.shape[2]}")
        return cls(
            experts=experts,
            num_experts=int(meta["num_experts"]),
            model=meta.get("model", ""),
            layer_ids=meta.get("layer_ids") or [],
            expert_bytes=int(meta.get("expert_bytes", 0)),
            **arrs,
        )

    # ---- JSONL ---------------------------------------------------------------
    def to_jsonl(self, path: str | Path) -> None:
        inv_phase = {v: k for k, v in PHASES.items()}
        with open(path, "w") as f:
            for i in range(len(self)):
                for li, lid in enumerate(self.layer_ids):
                    obj = {
                        "seq": int(self.seq[i]),
                        "layer": lid,
                        "token": int(self.token[i]),
                        "experts": self.experts[i, li].tolist(),
                    }
                    if self.weights is not None:
                        obj["weights"] = [round(float(w), 7) for w in self.weights[i, li]]
                    obj["phase"] = inv_phase[int(self.phase[i])]
                    obj["step"] = int(self.step[i])
                    f.write(json.dumps(obj) + "\n")

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        num_experts: int,
        model: str = "",
        expert_bytes: int = 0,
        num_layers: int | None = None,
    ) -> "RoutingTrace":
        """Parse JSONL (see module doc). Errors name the line and field."""
        rows: dict[tuple[int, int], dict] = {}  # (seq, token) -> {layer: (experts, weights, line)}
        meta_row: dict[tuple[int, int], tuple[int, int | None]] = {}  # (seq, token) -> (phase, step)
        layers: set[int] = set()
        shape: dict = {"top_k": None, "has_w": None}  # fixed by the first record
        with open(path) as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj, ex, w, ph, step = _record(line, ln, num_experts, shape)
                key = (obj["seq"], obj["token"])
                group = rows.setdefault(key, {})
                if obj["layer"] in group:
                    raise ValueError(
                        f"line {ln}: duplicate layer {obj['layer']} for seq {key[0]} token {key[1]}"
                    )
                group[obj["layer"]] = (ex, w, ln)
                meta_row.setdefault(key, (PHASES[ph], step))
                layers.add(obj["layer"])
        if not rows:
            raise ValueError(f"{path}: no records")
        layer_ids = sorted(layers)
        if num_layers is not None and len(layer_ids) != num_layers:
            raise ValueError(f"layer: trace has {len(layer_ids)} layers, model has {num_layers}")
        experts, weights, seq, token, phase, step = _arrays(
            rows, meta_row, layer_ids, shape["top_k"], shape["has_w"]
        )
        return cls(
            experts=experts,
            num_experts=num_experts,
            seq=seq,
            token=token,
            phase=phase,
            step=step,
            weights=weights,
            model=model,
            layer_ids=layer_ids,
            expert_bytes=expert_bytes,
        )


def _record(line: str, ln: int, num_experts: int, shape: dict):
    """One JSONL line checked -> (object, experts, weights or None, phase, step or None); `shape`'s
    top_k and has_w (whether lines carry weights) are set by the first record and held to after."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"line {ln}: invalid JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {ln}: expected a JSON object")
    for key in ("seq", "layer", "token", "experts"):
        if key not in obj:
            raise ValueError(f"line {ln}: missing field {key!r}")
    for key in ("seq", "layer", "token"):
        if not isinstance(obj[key], int):
            raise ValueError(f"line {ln}: field {key!r} must be an integer")
    ex = obj["experts"]
    if not isinstance(ex, list) or not all(isinstance(e, int) for e in ex) or not ex:
        raise ValueError(f"line {ln}: field 'experts' must be a non-empty list of integers")
    top_k = shape["top_k"] = shape["top_k"] or len(ex)
    if len(ex) != top_k:
        raise ValueError(f"line {ln}: field 'experts' has {len(ex)} ids, earlier lines {top_k}")
    bad = [e for e in ex if not 0 <= e < num_experts]
    if bad:
        raise ValueError(f"line {ln}: field 'experts' id {bad[0]} out of range [0, {num_experts})")
    w = obj.get("weights")
    if shape["has_w"] is None:
        shape["has_w"] = w is not None
    elif shape["has_w"] != (w is not None):
        raise ValueError(f"line {ln}: field 'weights' present on some lines only")
    if w is not None and (not isinstance(w, list) or len(w) != top_k):
        raise ValueError(f"line {ln}: field 'weights' must be a list of {top_k} numbers")
    ph = obj.get("phase", "decode")
    if ph not in PHASES:
        raise ValueError(f"line {ln}: field 'phase' must be 'prefill' or 'decode', got {ph!r}")
    step = obj.get("step")
    if step is not None and not isinstance(step, int):
        raise ValueError(f"line {ln}: field 'step' must be an integer")
    return obj, ex, w, ph, step


def _arrays(rows: dict, meta_row: dict, layer_ids: list[int], top_k: int, has_w: bool):
    """The parsed records as arrays, in step order when every record gives its step, else in file order:
    experts / weights [n, layers, top_k], seq / token / phase / step [n]. Every record must have every
    layer."""
    n, nl = len(rows), len(layer_ids)
    experts = np.empty((n, nl, top_k), np.int32)
    weights = np.empty((n, nl, top_k), np.float32) if has_w else None
    seq, token, phase, step = (np.empty(n, np.int64) for _ in range(4))
    keys = list(rows)
    steps_given = [meta_row[k][1] for k in keys]
    if all(s is not None for s in steps_given):
        order = sorted(range(n), key=lambda i: (steps_given[i], i))
    else:
        order = range(n)
    for r, i in enumerate(order):
        key = keys[i]
        group = rows[key]
        missing = [lid for lid in layer_ids if lid not in group]
        if missing:
            ln = next(iter(group.values()))[2]
            raise ValueError(f"layer: seq {key[0]} token {key[1]} (line {ln}) lacks layer {missing[0]}")
        for li, lid in enumerate(layer_ids):
            ex, w, _ = group[lid]
            experts[r, li] = ex
            if weights is not None:
                weights[r, li] = w
        seq[r], token[r] = key
        phase[r] = meta_row[key][0]
        step[r] = steps_given[i] if steps_given[i] is not None else r
    return experts, weights, seq, token, phase, step


def load_trace(path: str | Path, flag: str):
    """RoutingTrace.load with the flag (or argument) that named the file in every error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"{flag} {path}: {'is a directory' if p.is_dir() else 'no such file'} "
            f"(expected a routing trace .npz from --record-routing or `expertcache trace synth`)"
        )
    if not zipfile.is_zipfile(p):
        raise ConfigError(
            f"{flag} {path}: not a routing trace (.npz files are zip archives; this one is not)"
        )
    try:
        return RoutingTrace.load(p)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ConfigError(f"{flag} {path}: not a routing trace (.npz): {e}") from None
    except ValueError as e:
        msg = str(e)
        raise ConfigError(f"{flag} {path}: {msg.removeprefix(str(p) + ': ')}") from None
