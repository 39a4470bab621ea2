"""Tiny random Hugging Face MoE checkpoints for the tests.

`make_checkpoint(tmp_path, family, **config_overrides)` builds a small model with
transformers (the test oracle), re-initialises its weights so that logits and routing
are far from degenerate, and saves it the way a user's checkpoint looks:

    config.json, model.safetensors (or model-0000x-of-0000n.safetensors + index),
    generation_config.json, tokenizer.json, tokenizer_config.json (with a chat template)

The tokenizer is a tiny byte-level BPE trained once per process with the `tokenizers`
library (vocab ~320), so the model's vocab stays small and the tests fast.

`to_fused_layout(src, dst)` rewrites a checkpoint's per-expert tensors
(`...experts.{j}.gate_proj/up_proj/down_proj`, Mixtral `...experts.{j}.w1/w3/w2`) into the
fused 3-D layout transformers uses in memory (`...mlp.experts.gate_up_proj` [E, 2I, H],
`...mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from functools import lru_cache
from pathlib import Path

import torch

FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
)
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")  # Gated DeltaNet + gated attention

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A ChatML template in the style real checkpoints carry: a default system message,
# loop variables, string filters, and the generation prompt switch.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] | trim + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a
few experts out of many, and only those experts run. When the experts do not fit in fast
memory, the engine keeps a cache of the experts it used recently and loads the others from
the slower tier. Hello world! Hello there, how are you today? I am fine, thank you.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Stop here. The end of the story is near.
user assistant system: you are a helpful assistant. What is the capital of France? Paris.
"""


@lru_cache(maxsize=None)
def tokenizer_json(special_tokens: tuple[str, ...] = tuple(SPECIAL_TOKENS)) -> str:
    """A tiny byte-level BPE (specials first: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2 by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def tokenizer_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json()).get_vocab_size()


ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


def write_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    path = Path(path)
    (path / "tokenizer.json").write_text(tokenizer_json())
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------
# configs

_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    pad_token_id=ENDOFTEXT_ID,
    eos_token_id=IM_END_ID,
)


def default_config(family: str) -> dict:
    d = dict(_BASE)
    if family == "qwen3_moe":
        d.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=96,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif family == "qwen2_moe":
        d.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=96,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            qkv_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif family == "mixtral":
        d.update(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )
    elif family == "olmoe":
        d.update(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            rms_norm_eps=1e-5,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif family in HYBRID_FAMILIES:
        # 4 layers: 3 Gated DeltaNet + 1 full attention (the default full_attention_interval 4);
        # GQA in both mixers (4 q / 2 kv heads; 2 k / 4 v linear heads); partial rotary 0.25
        d.update(
            num_hidden_layers=4,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
        if family == "qwen3_next":
            d.update(norm_topk_prob=True, intermediate_size=96)
    elif family in MLA_FAMILIES or family == "glm4_moe":
        d.update(copy.deepcopy(MOE_DEEPSEEK))  # transformers' configs edit rope_parameters in place
        if family in MLA_FAMILIES:  # multi-head latent attention: heads are not grouped
            d.update(MLA, num_key_value_heads=d["num_attention_heads"])
        if family == "deepseek_v2":
            d.update(topk_method="greedy", routed_scaling_factor=1.5, norm_topk_prob=False)
        elif family == "deepseek_v3":
            d.update(n_group=2, topk_group=1, routed_scaling_factor=2.5)
        elif family == "glm4_moe":
            d.update(head_dim=16, routed_scaling_factor=1.5, rms_norm_eps=1e-5)
        else:
            d.update(mlp_layer_types=["dense", "sparse"], routed_scaling_factor=1.8, rms_norm_eps=1e-5)
            d.pop("first_k_dense_replace")
    else:
        raise ValueError(f"unknown family {family!r}")
    return d


MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
# multi-head latent attention dims (DeepSeek-V3 proportions, scaled down): q 24 -> 4 heads x (8 + 4),
# latent 16 + rope 4 per token in the KV cache
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
# 8 routed experts top-2, one shared expert, first layer dense
MOE_DEEPSEEK = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=96,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def hf_config(family: str, **overrides):
    import transformers

    cls = getattr(
        transformers,
        {
            "qwen3_moe": "Qwen3MoeConfig",
            "qwen3_next": "Qwen3NextConfig",
            "qwen3_5_moe": "Qwen3_5MoeTextConfig",
            "qwen2_moe": "Qwen2MoeConfig",
            "mixtral": "MixtralConfig",
            "olmoe": "OlmoeConfig",
            "deepseek_v2": "DeepseekV2Config",
            "deepseek_v3": "DeepseekV3Config",
            "glm4_moe": "Glm4MoeConfig",
            "glm4_moe_lite": "Glm4MoeLiteConfig",
        }[family],
    )
    kw = default_config(family)
    kw.setdefault("vocab_size", tokenizer_vocab_size())
    kw.update(overrides)
    return cls(**kw)


# ---------------------------------------------------------------------------
# weights


@torch.no_grad()
def randomize_(model, seed: int = 0) -> None:
    """Re-initialise every parameter so the math is well conditioned and every field matters.

    Norm weights become 1 + noise (so a missing/misplaced norm weight shows), biases are
    non-zero, router weights are large (routing decisions are far from ties) and the
    lm_head spreads the logits (greedy decoding has clear winners).
    """
    g = torch.Generator().manual_seed(seed)
    # Qwen3-Next / Qwen3.5 RMSNorms scale by (1 + weight), except the DeltaNet's gated norm
    zero_centred = model.config.model_type in ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")

    def randn(p):
        return torch.randn(p.shape, generator=g, dtype=torch.float32)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or re.search(r"norm\.weight$", name):
            centre = 0.0 if zero_centred and not name.endswith("linear_attn.norm.weight") else 1.0
            p.copy_(centre + 0.1 * randn(p))
        elif name.endswith(".bias"):
            p.copy_(0.1 * randn(p))
        elif name.endswith("shared_expert_gate.weight"):
            p.copy_(0.3 * randn(p))
        elif re.search(r"\.(mlp|block_sparse_moe)\.gate\.weight$", name):  # routers
            p.copy_(0.5 * randn(p))
        elif "embed_tokens" in name:
            p.copy_(0.5 * randn(p))
        elif name.startswith("lm_head"):
            p.copy_(0.3 * randn(p))
        else:
            p.copy_(0.1 * randn(p))


def build_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    return model


def write_generation_config(path: Path, eos_token_id=(IM_END_ID, ENDOFTEXT_ID), **extra) -> None:
    gen = {
        "eos_token_id": list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else eos_token_id,
        "pad_token_id": ENDOFTEXT_ID,
        "do_sample": False,
    }
    gen.update(extra)
    (Path(path) / "generation_config.json").write_text(json.dumps(gen, indent=2))


def make_checkpoint(
    tmp_path,
    family: str,
    *,
    name: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    chat_template: str = CHAT_TEMPLATE,
    **config_overrides,
) -> Path:
    """Build, randomise and save a tiny `family` checkpoint; return its directory.

    dtype: the dtype of the saved tensors (torch.bfloat16 for a bf16 checkpoint).
    max_shard_size: e.g. "100KB" for a sharded checkpoint with model.safetensors.index.json.
    """
    model = build_model(family, seed=seed, **config_overrides)
    out = Path(tmp_path) / (name or f"{family}-{seed}")
    out.mkdir(parents=True, exist_ok=True)
    if dtype != torch.float32:
        model = model.to(dtype)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kw)
    write_generation_config(out)
    if tokenizer:
        write_tokenizer(out, chat_template)
    return out


def load_reference(path, dtype: torch.dtype = torch.float32):
    """The transformers model for a checkpoint directory: eager attention, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model.eval()
    return model


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(ids), vocab] for one sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy decoding (`generate(do_sample=False)`) of exactly n tokens, EOS disabled."""
    from transformers import GenerationConfig

    # generate() fills unset fields of the passed config from model.generation_config (which holds
    # the checkpoint's eos ids), so EOS must be cleared there too.
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        gen = GenerationConfig(
            max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=ENDOFTEXT_ID
        )
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)
    finally:
        model.generation_config.eos_token_id = saved
    tokens = out[0, len(ids) :].tolist()
    assert len(tokens) == n, f"transformers stopped after {len(tokens)} of {n} tokens"
    return tokens


# ---------------------------------------------------------------------------
# checkpoint surgery


def read_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def tensor_files(path) -> dict[str, str]:
    """tensor name -> safetensors file name, for a single-file or sharded checkpoint."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = f.name
    return out


def copy_checkpoint(src, dst) -> Path:
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(path, fn) -> None:
    """Apply fn(dict name->tensor) -> dict to every tensor of a checkpoint, written as one file."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = fn(read_tensors(path))
    for f in path.glob("*.safetensors"):
        f.unlink()
    index = path / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )


_EXPERT_RE = re.compile(
    r"^(?P<prefix>model\.layers\.\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<j>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert 2-D tensors -> `{prefix}.mlp.experts.gate_up_proj` [E, 2I, H] and `.down_proj` [E, H, I].

    Mixtral's `block_sparse_moe.gate.weight` (router) moves to `mlp.gate.weight` with it, the
    way transformers 5 names the fused model in memory.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _EXPERT_RE.match(name)
        if m is None:
            if ".block_sparse_moe.gate." in name:
                name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            out[name] = t
            continue
        proj = _PROJ.get(m["proj"], m["proj"])
        experts.setdefault(m["prefix"], {}).setdefault(proj, {})[int(m["j"])] = t
    for prefix, projs in experts.items():
        n = len(projs["gate_proj"])
        gate = torch.stack([projs["gate_proj"][j] for j in range(n)])  # [E, I, H]
        up = torch.stack([projs["up_proj"][j] for j in range(n)])  # [E, I, H]
        down = torch.stack([projs["down_proj"][j] for j in range(n)])  # [E, H, I]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.mlp.experts.down_proj"] = down
    return out


def to_fused_layout(src, dst) -> Path:
    """Copy checkpoint `src` to `dst` with the experts in the fused 3-D layout."""
    dst = copy_checkpoint(src, dst)
    rewrite_tensors(dst, fuse_experts)
    return dst


def edit_config(path, **changes) -> dict:
    """Update (value) or delete (value=DELETE) config.json fields; returns the new config."""
    p = Path(path) / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg, indent=2))
    return cfg


DELETE = object()
