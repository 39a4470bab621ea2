"""What bench/gpu_check.py runs on: a random Qwen3-MoE checkpoint written with safetensors alone, and the
routing that drives it (a trace recorded from the shipped trained demo model, mapped onto the bench
model's layers and experts; or uniform random routing, the worst case).

Shapes (Qwen3-30B-A3B's hidden 2048 : expert intermediate 768, 32 query / 4 KV heads of 128, top-8):
    BENCH  12 MoE layers x 64 experts (9.4 MB each in bf16: 7.2 GB of experts), vocab 32000
    TINY   the same structure at toy widths (the CPU dry run that CI runs)
64 experts rather than Qwen3's 128: the demo model routes 4 of 32 experts, so each demo expert maps to
2 bench experts (a token's 4 become 8) and every bench expert is used; the demo's reuse and skew carry
over unchanged at the same share of experts cached.

Routing tables are [rows, bench layers, top_k] int64 on the model's device (indexing them costs no host
sync); `TableRouter` is the engine's `route_override` (models/transformer.py): row r of the table is the
r-th token row the engine runs after `restart()`, and its `lookahead` gives the next layer's prediction
(recorded: the demo router's own prediction; random: an independent draw, i.e. no information).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BENCH = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=32000,
    num_hidden_layers=12,
)
TINY = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts=64,
    num_experts_per_tok=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    num_hidden_layers=2,
)
STD = 0.02


def config_json(shape: dict) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **shape,
        "intermediate_size": 3 * shape["hidden_size"],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 0,
    }


def layer_tensors(shape: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer i's tensors in bf16 (random, std 0.02; norms 1)."""
    H, I, E = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts"]
    nq, nkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]

    def rnd(*s):
        return (torch.randn(*s, generator=gen) * STD).to(torch.bfloat16)

    p = f"model.layers.{i}"
    out = {
        f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{p}.self_attn.q_proj.weight": rnd(nq * d, H),
        f"{p}.self_attn.k_proj.weight": rnd(nkv * d, H),
        f"{p}.self_attn.v_proj.weight": rnd(nkv * d, H),
        f"{p}.self_attn.o_proj.weight": rnd(H, nq * d),
        f"{p}.self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        f"{p}.self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        f"{p}.mlp.gate.weight": rnd(E, H),
    }
    for e in range(E):
        q = f"{p}.mlp.experts.{e}"
        out |= {
            f"{q}.gate_proj.weight": rnd(I, H),
            f"{q}.up_proj.weight": rnd(I, H),
            f"{q}.down_proj.weight": rnd(H, I),
        }
    return out


def write_checkpoint(out: Path, shape: dict, seed: int = 0) -> Path:
    """A sharded safetensors checkpoint (one file per layer) + config.json in `out`; kept when its
    config matches (`shape` and seed), rewritten otherwise."""
    from safetensors.torch import save_file

    cfg = config_json(shape)
    marker = out / "gpu_check.json"
    if marker.exists() and json.loads(marker.read_text()) == {"config": cfg, "seed": seed}:
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    H, V = shape["hidden_size"], shape["vocab_size"]
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update((k, name) for k in tensors)

    shard(
        "embed.safetensors",
        {"model.embed_tokens.weight": (torch.randn(V, H, generator=gen) * STD).bfloat16()},
    )
    for i in range(shape["num_hidden_layers"]):
        shard(f"layer-{i:03d}.safetensors", layer_tensors(shape, i, gen))
    shard(
        "head.safetensors",
        {
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
            "lm_head.weight": (torch.randn(V, H, generator=gen) * STD).bfloat16(),
        },
    )
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    marker.write_text(json.dumps({"config": cfg, "seed": seed}))
    return out


def expert_bytes(shape: dict) -> int:
    """All routed experts' bytes (bf16)."""
    return (
        shape["num_hidden_layers"]
        * shape["num_experts"]
        * 3
        * shape["hidden_size"]
        * shape["moe_intermediate_size"]
        * 2
    )


def record_demo_trace(path: Path, prompt_len: int, new_tokens: int) -> Path:
    """Route the held-out text of the shipped trained demo model (CPU): `prompt_len` prompt tokens,
    then `new_tokens` greedy tokens; its routing as a trace file (.npz)."""
    from expertcache import LLM, SamplingParams
    from expertcache.demo import demo_model_dir

    model = demo_model_dir(progress=False)
    llm = LLM(str(model), device="cpu", record_routing=str(path))
    ids = llm.require_tokenizer().encode((model / "heldout.txt").read_text(), add_special_tokens=False)
    if len(ids) < prompt_len:
        raise ValueError(f"{model / 'heldout.txt'} has {len(ids)} tokens; the prompt needs {prompt_len}")
    llm.generate(
        [ids[:prompt_len]], SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    )
    llm.close()
    return path


def demo_layer(layer: int, demo_layers: int) -> int:
    """The demo layer whose routing bench MoE layer `layer` replays: 0 for 0, then 1..demo_layers-1
    in turn (demo layer 0 has no next-layer prediction recorded, so it is not reused)."""
    return 0 if layer == 0 else 1 + (layer - 1) % (demo_layers - 1)


def map_trace(experts, lookahead, num_experts: int, top_k: int, layers: int, seed: int = 0):
    """Demo routing [N, Ld, Kd] (and its lookahead) -> bench routing [N, layers, top_k]: demo expert d of
    bench layer l becomes bench experts perm_l[d*m .. d*m+m-1] (m = top_k / Kd; perm_l a fixed
    permutation per bench layer)."""
    ex, la = torch.as_tensor(experts, dtype=torch.int64), torch.as_tensor(lookahead, dtype=torch.int64)
    N, Ld, Kd = ex.shape
    m = top_k // Kd
    if m * Kd != top_k or int(ex.max()) >= num_experts // m or num_experts % m:
        raise ValueError(
            f"a trace of top-{Kd} over {int(ex.max()) + 1}+ experts cannot map onto top-{top_k} "
            f"of {num_experts}"
        )
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(num_experts, generator=gen) for _ in range(layers)]
    j = torch.arange(m)

    def one(src: torch.Tensor, bl: int) -> torch.Tensor:  # [N, Kd] -> [N, top_k]
        return perms[bl][(src.clamp(min=0)[:, :, None] * m + j).reshape(N, top_k)]

    cols = [demo_layer(bl, Ld) for bl in range(layers)]
    out = torch.stack([one(ex[:, c], bl) for bl, c in enumerate(cols)], 1)
    ahead = torch.stack([one(la[:, c] if c > 0 else ex[:, 0], bl) for bl, c in enumerate(cols)], 1)
    return out, ahead


def random_routing(rows: int, num_experts: int, top_k: int, layers: int, seed: int = 0):
    """Uniform random top-k per row and layer, and an independent draw as its prediction."""
    gen = torch.Generator().manual_seed(seed)

    def draw():
        return torch.rand(rows, layers, num_experts, generator=gen).argsort(-1)[..., :top_k]

    return draw(), draw()


class TableRouter:
    """The engine's route_override: token row r (counted from `restart()`) of MoE layer l takes the
    experts table[r % rows, l]; `lookahead` the prediction table's. Tables live on the model's device."""

    def __init__(self, table: torch.Tensor, ahead: torch.Tensor, moe_layers: list[int], device):
        self.ex, self.la = table.to(device), ahead.to(device)
        self.li = {layer: i for i, layer in enumerate(moe_layers)}
        self.first = moe_layers[0]
        self.restart()

    def restart(self) -> None:
        self.row, self.T = 0, 0

    def _rows(self, n: int) -> torch.Tensor:
        return torch.arange(self.row, self.row + n, device=self.ex.device) % self.ex.shape[0]

    def __call__(self, layer, ids, w):
        if layer == self.first:
            self.row += self.T
            self.T = ids.shape[0]
        return self.ex[self._rows(ids.shape[0]), self.li[layer]], w

    def lookahead(self, layer, ids):
        return self.la[self._rows(ids.shape[0]), self.li[layer]]
