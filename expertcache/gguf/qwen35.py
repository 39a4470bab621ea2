"""qwen35moe (Qwen3.5/3.6-MoE: Gated DeltaNet + gated attention + MoE) as llama.cpp's converter writes it,
read back as the Hugging Face checkpoint (convert_hf_to_gguf.py: Qwen3_5MoeTextModel, through
_LinearAttentionVReorderBase and Qwen3NextModel). What it names and changes, undone here (`undo`):

    GGUF (blk.N.)          HF (model.layers.N.)              the converter's change
    attn_qkv.weight        linear_attn.in_proj_qkv.weight    v rows tiled (below)
    attn_gate.weight       linear_attn.in_proj_z.weight      rows tiled
    ssm_beta.weight        linear_attn.in_proj_b.weight      rows tiled (one per v head)
    ssm_alpha.weight       linear_attn.in_proj_a.weight      rows tiled
    ssm_conv1d.weight      linear_attn.conv1d.weight         [C, 1, K] squeezed to [C, K]; v channels tiled
    ssm_dt.bias            linear_attn.dt_bias               tiled
    ssm_a                  linear_attn.A_log                 written as -exp(A_log), tiled
    ssm_norm.weight        linear_attn.norm.weight           none (the gated norm's weight is plain)
    ssm_out.weight         linear_attn.out_proj.weight       columns tiled
    *_norm.weight          the zero-centred RMSNorms         written as 1 + weight (attn_norm,
                           (input/post_attention_layernorm,   post_attention_norm, attn_q_norm,
                           q/k_norm, model.norm)              attn_k_norm, output_norm)
    ffn_gate_inp_shexp     mlp.shared_expert_gate.weight     none ([1, H]; a 1-D [H] file is served [1, H])

Tiled: where there are more v heads than k heads (Hv = r x Hk), HF orders v heads by their k head
(k0: v0..v(r-1), k1: ...); the converter writes them tiled (v0 of k0, v0 of k1, ..., v1 of k0, ...),
so ggml broadcasts k over v without an interleaved repeat. `untile` puts them back (exact: a reorder).
The attention's q_proj (q and the output gate interleaved per head) and the experts are written as HF
holds them; the MTP layer(s) follow the decoder's layers (families.py, models/mtp.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CheckpointError

# GGUF layer tensor (after "blk.N.") -> HF (after "model.layers.N.")
LAYER_NAMES = (
    ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
    ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
    ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
    ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
    ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    ("ssm_dt.bias", "linear_attn.dt_bias"),
    ("ssm_a", "linear_attn.A_log"),
    ("ssm_norm.weight", "linear_attn.norm.weight"),
    ("ssm_out.weight", "linear_attn.out_proj.weight"),
)


def untile(t: torch.Tensor, dim: int, k_heads: int, r: int, head_dim: int) -> torch.Tensor:
    """Heads along `dim` from the converter's tiled order [r, Hk, d] back to HF's grouped [Hk, r, d]."""
    shape = t.shape
    t = t.reshape(*shape[:dim], r, k_heads, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


class Undo:
    """One file's inverse transforms: `(name, stored shape) -> (HF shape, fn or None)`; fn(tensor in the HF
    shape, float) -> the HF values. Sizes from the ssm.* metadata (families.py checks them)."""

    def __init__(self, path, metadata: dict, arch: str):
        def req(key):
            if f"{arch}.{key}" not in metadata:
                raise CheckpointError(
                    f"{path}: missing metadata {arch}.{key} (needed for the {arch} tensors)"
                )
            return int(metadata[f"{arch}.{key}"])

        self.hk, self.hv = req("ssm.group_count"), req("ssm.time_step_rank")
        self.dk, self.dv = req("ssm.state_size"), req("ssm.inner_size") // self.hv
        self.r = self.hv // self.hk

    def __call__(self, name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], Callable | None]:
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return shape, _minus_one
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            return (1, shape[0]), None
        if ".linear_attn." not in name:
            return shape, None
        if name.endswith("conv1d.weight"):  # [C, K] -> [C, 1, K]; the v channels after q and k
            shape = (shape[0], 1, shape[-1])
        tiled = self._untile(name)
        if name.endswith("A_log"):  # stored -exp(A_log)
            return shape, lambda t: tiled(torch.log(-t)) if tiled else torch.log(-t)
        return shape, tiled

    def _untile(self, name: str) -> Callable | None:
        kd, r, hk, dv = self.hk * self.dk, self.r, self.hk, self.dv
        if r == 1:  # the converter reorders only where Hv > Hk
            return None
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # v rows / channels after q and k
            return lambda t: torch.cat((t[: 2 * kd], untile(t[2 * kd :], 0, hk, r, dv)))
        if name.endswith("in_proj_z.weight"):
            return lambda t: untile(t, 0, hk, r, dv)
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log")):
            return lambda t: untile(t, 0, hk, r, 1)
        if name.endswith("out_proj.weight"):
            return lambda t: untile(t, 1, hk, r, dv)
        return None  # the gated norm [Dv]


def _minus_one(t: torch.Tensor) -> torch.Tensor:
    return t.float() - 1.0
