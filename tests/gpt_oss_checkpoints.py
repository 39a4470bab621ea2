"""Tiny random GPT-OSS checkpoints for the tests, as transformers saves them and as OpenAI ships them.

`make_gpt_oss(root, **config_overrides)` builds a GptOssForCausalLM with transformers, re-initialises
it so that sinks, biases, the router and the SwiGLU clamp all matter, and saves it with
save_pretrained (experts fused: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H], biases),
plus generation_config.json (GPT-OSS's three stop tokens) and a tokenizer with the harmony special
tokens and a harmony chat template (tests/fixtures/gpt_oss_chat_template.jinja).

`to_shipped_mxfp4(src, dst)` rewrites it the way openai/gpt-oss-* ship: experts as
`gate_up_proj_blocks` [E, 2I, H/32, 16] / `gate_up_proj_scales` [E, 2I, H/32] (and down_proj's),
biases and every dense weight in bf16, `quantization_config: {quant_method: mxfp4, ...}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import checkpoints as C
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CHAT_TEMPLATE = (FIXTURES / "gpt_oss_chat_template.jinja").read_text()

# GptOssConfig's own rope (what openai/gpt-oss-* use), for a config that sets max_position_embeddings to match
SHIPPED_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}

# harmony's special tokens (ids 0..8 in the tiny tokenizer)
SPECIALS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
STARTOFTEXT, ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = range(len(SPECIALS))
EOS_IDS = (
    RETURN,
    ENDOFTEXT,
    CALL,
)  # generation_config.json of openai/gpt-oss-20b: <|return|>, <|endoftext|>, <|call|>

BASE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
    pad_token_id=ENDOFTEXT,
    eos_token_id=RETURN,
    bos_token_id=None,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


def vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(C.tokenizer_json(SPECIALS)).get_vocab_size()


def hf_config(**overrides):
    from transformers import GptOssConfig

    kw = {**BASE, "vocab_size": vocab_size(), **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        kw.pop("layer_types")
    return GptOssConfig(**kw)


@torch.no_grad()
def randomize_(model, seed: int = 0, expert_std: float = 0.25) -> None:
    """checkpoints.randomize_, then GPT-OSS's own parameters: sinks of either sign and size (some
    heads mostly attend to the sink), a decisive router with a bias, and expert weights large enough
    that the SwiGLU clamp (swiglu_limit) cuts some gate and up values."""
    C.randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("self_attn.sinks"):
            p.copy_(1.5 * r)
        elif name.endswith("mlp.router.weight"):
            p.copy_(0.5 * r)
        elif name.endswith("mlp.router.bias"):
            p.copy_(0.5 * r)
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            p.copy_(expert_std * r)


def build_model(seed: int = 0, expert_std: float = 0.25, **overrides):
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(hf_config(**overrides)).to(torch.float32)
    randomize_(model, seed, expert_std)
    return model.eval()


def write_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    (path / "tokenizer.json").write_text(C.tokenizer_json(SPECIALS))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "additional_special_tokens": list(SPECIALS[2:]),
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def make_gpt_oss(
    root,
    name: str = "gpt-oss",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    expert_std: float = 0.25,
    **overrides,
) -> Path:
    model = build_model(seed, expert_std, **overrides)
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    C.write_generation_config(out, eos_token_id=EOS_IDS, bos_token_id=STARTOFTEXT, pad_token_id=ENDOFTEXT)
    write_tokenizer(out)
    return out


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused expert weight as transformers holds it [E, in, out] -> (blocks [E, out, in/32, 16], scales [E, out, in/32])."""
    from expertcache.quant.mxfp4 import quantize_mxfp4

    pairs = [quantize_mxfp4(w[e].T.float()) for e in range(w.shape[0])]
    return torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])


def to_shipped_mxfp4(src, dst) -> Path:
    """Copy checkpoint `src` to `dst` in openai/gpt-oss-*'s layout (see the module docstring)."""
    dst = C.copy_checkpoint(src, dst)

    def convert(tensors):
        out = {}
        for k, t in tensors.items():
            if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
                out[k + "_blocks"], out[k + "_scales"] = pack_mxfp4(t)
            else:
                out[k] = t.to(torch.bfloat16)
        return out

    C.rewrite_tensors(dst, convert)
    C.edit_config(
        dst,
        dtype="bfloat16",
        quantization_config={
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
    )
    return dst


def dequantized_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in float32, its MXFP4 `*_blocks`/`*_scales` pairs dequantized by transformers'
    own GPT-OSS converter (integrations.mxfp4.convert_moe_packed_tensors)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = {}
    for k, t in tensors.items():
        if k.endswith("_blocks"):
            base = k.removesuffix("_blocks")
            state[base] = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=torch.float32)
        elif not k.endswith("_scales"):
            state[k] = t.float()
    return state


def dequantized_reference(mxfp4_dir, like_dir):
    """transformers' GptOssForCausalLM (fp32) with the weights of an MXFP4 checkpoint, the experts
    dequantized by transformers' own GPT-OSS converter (integrations.mxfp4.convert_moe_packed_tensors)."""
    from transformers import AutoModelForCausalLM

    state = dequantized_state(C.read_tensors(mxfp4_dir))
    model = AutoModelForCausalLM.from_pretrained(like_dir, dtype=torch.float32, attn_implementation="eager")
    model.load_state_dict(state, strict=True)
    return model.eval()
