"""DeepSeek-V2/V3, GLM-4.5 and GLM-4.7-Flash beyond the shared family checks of test_families.py.

References: transformers (logits), the same checkpoint with every expert resident (cache tiers,
prefix reuse), the naive MLA path (absorbed path), the latent size (KV bytes), the hub configs as
published (parsing, plan sizes) and transformers' rendering of the DeepSeek-V3 chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import checkpoints as C
import pytest
import torch
from safetensors_reference import independent_slot_checks

from expertcache import LLM, SamplingParams
from expertcache.cli import main
from expertcache.engine.kv_cache import KVCache
from expertcache.errors import ConfigError
from expertcache.experts.policy import POLICIES
from expertcache.layers.mla import MLAttention
from expertcache.models.registry import FAMILIES, read_config


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEQ = [(i * 29 + 7) % 300 + 3 for i in range(40)]
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [100, 101, 102], [9] * 20]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# 16 experts (4 groups of 4 where the family groups), 3 layers with a dense first one, bf16 storage
CACHE_CASES = {
    "deepseek_v2": dict(
        n_routed_experts=16, num_hidden_layers=3, topk_method="group_limited_greedy", n_group=4, topk_group=2
    ),
    "deepseek_v3": dict(n_routed_experts=16, num_hidden_layers=3, n_group=4, topk_group=2),
    "glm4_moe": dict(n_routed_experts=16, num_hidden_layers=3, use_qk_norm=True, attention_bias=True),
    "glm4_moe_lite": dict(
        n_routed_experts=16, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"]
    ),
}


@pytest.fixture(scope="module", params=sorted(CACHE_CASES))
def family_ckpt(request, checkpoint):
    return request.param, checkpoint(request.param, dtype=torch.bfloat16, **CACHE_CASES[request.param])


_resident: dict = {}


def resident(path):
    """Logits and greedy tokens of the all-resident engine (itself equal to transformers)."""
    if path not in _resident:
        llm = LLM(str(path))
        _resident[path] = (llm.logits(SEQ), [o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    return _resident[path]


def test_resident_bf16_matches_transformers(family_ckpt):
    _, path = family_ckpt
    ref = C.load_reference(path, dtype=torch.float32)
    logits, tokens = resident(path)
    torch.testing.assert_close(logits, C.reference_logits(ref, SEQ), atol=1e-4, rtol=1e-4)
    assert tokens[0] == C.reference_greedy(ref, PROMPTS[0], GREEDY.max_tokens)


@pytest.mark.parametrize("policy", sorted(p for p in POLICIES if p != "min"))
def test_tight_budget_device_host_disk_equals_resident(family_ckpt, policy):
    """2 of 16 experts per layer in the fastest tier, 2 more in host RAM, the rest read from disk."""
    _, path = family_ckpt
    logits, tokens = resident(path)
    llm = LLM(str(path), verify=True, device_memory="13%", host_memory="13%", cache_policy=policy)
    try:
        assert llm.experts.device_slots == 2 and llm.experts.host_slots == 2, llm.plan_lines
        torch.testing.assert_close(llm.logits(SEQ), logits, atol=1e-5, rtol=0)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
        llm.experts.check(contents=True)
        assert llm.expert_stats()["per_tier"]["disk"]["bytes_read"] > 0
    finally:
        llm.close()


def test_low_memory_streaming_equals_resident(family_ckpt):
    """bf16 dense weights (MLA projections included) converted per use, bf16 expert slots, no host tier."""
    _, path = family_ckpt
    logits, tokens = resident(path)
    llm = LLM(str(path), verify=True, device_memory="25%", host_memory="0", low_memory=True)
    try:
        assert llm.model.lm_head.dtype == torch.bfloat16
        torch.testing.assert_close(llm.logits(SEQ), logits, atol=1e-4, rtol=1e-4)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
    finally:
        llm.close()


def test_prefix_reuse_equals_fresh(family_ckpt):
    """Prompts sharing cached KV blocks (the MLA latent cache included) give a fresh engine's tokens."""
    _, path = family_ckpt
    common = [(7 * i) % 300 + 3 for i in range(40)]
    prompts = [common + [100, 101], common + [200], common[:33] + [7, 8, 9], common + [100, 101]]
    fresh = LLM(str(path), prefix_caching=False)
    expected = [fresh.generate([p], GREEDY)[0].token_ids for p in prompts]
    llm = LLM(str(path))
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.generate([prompts[0]], GREEDY)[0].num_cached_tokens >= 32


# -- MLA: latent cache, two exact paths ------------------------------------------------------------------


def _mla_llm(checkpoint, family="deepseek_v3", **kw):
    path = checkpoint(family, **CACHE_CASES[family])
    return path, LLM(str(path), **kw)


def _set_path(llm, path):
    for layer in llm.model.layers:
        layer["attn"].path = path


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_absorbed_path_equals_naive(checkpoint, family):
    """Forced naive and forced absorbed attention give the same logits (prefill), the same tokens
    (batched decode, chunked prefill) and transformers' logits."""
    path, llm = _mla_llm(checkpoint, family, max_num_batched_tokens=7)
    ref = C.reference_logits(C.load_reference(path), SEQ)
    out = {}
    for p in ("naive", "absorbed"):
        _set_path(llm, p)
        out[p] = llm.logits(SEQ), [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        torch.testing.assert_close(out[p][0], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["naive"][0], out["absorbed"][0], atol=2e-5, rtol=0)
    assert out["naive"][1] == out["absorbed"][1]


def test_path_choice_decode_absorbed_long_prefill_naive(checkpoint):
    """With DeepSeek-V3's dims the multiply-add count picks absorbed for decode and naive for a
    long prefill; the tiny model's own choice follows the same rule."""
    _, llm = _mla_llm(checkpoint)
    attn = llm.model.layers[0]["attn"]
    assert isinstance(attn, MLAttention) and attn.path == "auto"
    attn.h, attn.N, attn.P, attn.V, attn.R = 128, 128, 64, 128, 512
    assert attn.choose(T=1, B=1, Q=1, L=4096) == "absorbed"
    assert attn.choose(T=8, B=8, Q=1, L=1024) == "absorbed"
    assert attn.choose(T=2048, B=1, Q=2048, L=2048) == "naive"


def test_kv_bytes_per_token_are_the_latent(checkpoint, capsys):
    path, llm = _mla_llm(checkpoint)
    cfg, m = llm.cfg, llm.cfg.mla
    latent = m.kv_lora_rank + m.qk_rope_head_dim  # 16 + 4 values per layer and token
    assert cfg.kv_token_shapes == ((latent,),)
    assert [tuple(t.shape[1:]) for t in llm.kv.tensors[0]] == [(llm.kv.block_size, latent)]
    per_token = KVCache.bytes_per_block(cfg.num_layers, 1, cfg.kv_token_shapes, torch.float32)
    assert per_token == cfg.num_layers * latent * 4
    expanded = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert expanded > 4 * per_token
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"]["bytes_per_token"] == per_token


def test_n_samples_fork_the_latent_cache(checkpoint):
    """n samples share the prompt's latent blocks and copy the partial one on write: each equals its
    single run with the same seed."""
    _, llm = _mla_llm(checkpoint, prefix_caching=False)
    prompt = [(i * 11 + 3) % 300 + 3 for i in range(40)]
    outs = llm.generate([prompt], SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True))
    for o in outs:
        alone = llm.generate(
            [prompt], SamplingParams(seed=7 + o.index, temperature=1.0, max_tokens=6, ignore_eos=True)
        )[0]
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_long_prompt_fits_the_latent_budget(checkpoint):
    """A 240-token prompt in a KV budget of 256 latent tokens (a fifth of what expanded heads need)."""
    path = checkpoint("deepseek_v3", **CACHE_CASES["deepseek_v3"])
    family, cfg, _ = read_config(path)
    per_token = KVCache.bytes_per_block(cfg.num_layers, 1, cfg.kv_token_shapes, torch.float32)
    budget = 256 * per_token
    m = cfg.mla
    expanded = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4
    assert 240 * expanded > 4 * budget
    llm = LLM(str(path), kv_cache_memory=budget, max_model_len=256)
    assert llm.kv.num_blocks * llm.kv.block_size == 256
    prompt = [(i * 13 + 5) % 300 + 3 for i in range(240)]
    ref = C.load_reference(path)
    torch.testing.assert_close(llm.logits(prompt), C.reference_logits(ref, prompt), atol=1e-4, rtol=1e-4)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == C.reference_greedy(ref, prompt, 16)
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        LLM(str(path), kv_cache_memory=budget - per_token * 16, max_model_len=256)


# -- config fields parsed or rejected by name ----------------------------------------------------------


@pytest.mark.parametrize(
    "family,changes,match",
    [
        ("deepseek_v2", dict(topk_method="sparsemixer"), r"topk_method='sparsemixer' is not supported"),
        ("deepseek_v3", dict(topk_method="greedy"), r"topk_method='greedy' is not supported"),
        ("deepseek_v2", dict(norm_topk_prob=True), r"norm_topk_prob=true is not supported"),
        ("deepseek_v3", dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported"),
        ("deepseek_v3", dict(n_group=3), r"n_group=3 must divide n_routed_experts=16"),
        ("deepseek_v3", dict(num_key_value_heads=2), r"num_key_value_heads=2 must equal num_attention_heads"),
        ("deepseek_v2", dict(mlp_bias=True), r"mlp_bias"),
        (
            "deepseek_v3",
            dict(
                rope_scaling={
                    "type": "yarn",
                    "factor": 4,
                    "partial_rotary_factor": 0.5,
                    "original_max_position_embeddings": 64,
                }
            ),
            r"partial_rotary_factor",
        ),
        (
            "glm4_moe_lite",
            dict(mlp_layer_types=["dense", "sparse"]),
            r"mlp_layer_types=.* each of the 3 layers",
        ),
        (
            "glm4_moe_lite",
            dict(first_k_dense_replace=2),
            r"first_k_dense_replace=2 disagrees with mlp_layer_types",
        ),
        (
            "glm4_moe",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
            r"partial_rotary_factor=0.1 of head_dim=16 gives 1 rotary dims",
        ),
        ("glm4_moe", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_config_is_a_clear_error(checkpoint, tmp_path, family, changes, match):
    path = C.copy_checkpoint(checkpoint(family, **CACHE_CASES[family]), tmp_path / "model")
    C.edit_config(path, **changes)
    with pytest.raises(ConfigError, match=match):
        LLM(str(path))


def test_moe_layer_freq_places_sparse_layers(tmp_path):
    """DeepSeek's placement: layer i is sparse iff i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    from expertcache.models.deepseek import deepseek_sparse_layers

    assert deepseek_sparse_layers({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 6) == (
        False,
        False,
        True,
        False,
        True,
        False,
    )
    assert deepseek_sparse_layers({"first_k_dense_replace": 3}, 5) == (False, False, False, True, True)


# -- multi-token-prediction layers ---------------------------------------------------------------------


def _with_mtp_layer(src: Path, dst: Path) -> Path:
    """DeepSeek-V3's layout: one MTP layer after the last decoder layer (model.layers.{n}.*: a full
    decoder layer with its experts, plus enorm / hnorm / eh_proj / shared_head), and
    num_nextn_predict_layers=1 in config.json."""
    dst = C.copy_checkpoint(src, dst)
    n = json.loads((dst / "config.json").read_text())["num_hidden_layers"]

    def add(t):
        last = f"model.layers.{n - 1}."
        extra = {k.replace(last, f"model.layers.{n}."): v.clone() for k, v in t.items() if k.startswith(last)}
        H = t["model.norm.weight"].shape[0]
        extra.update(
            {
                f"model.layers.{n}.enorm.weight": torch.ones(H),
                f"model.layers.{n}.hnorm.weight": torch.ones(H),
                f"model.layers.{n}.eh_proj.weight": torch.zeros(H, 2 * H),
                f"model.layers.{n}.shared_head.norm.weight": torch.ones(H),
            }
        )
        return {**t, **extra}

    C.rewrite_tensors(dst, add)
    C.edit_config(dst, num_nextn_predict_layers=1)
    return dst


def test_mtp_layers_are_ignored_with_a_note(checkpoint, tmp_path, capsys):
    src = checkpoint("deepseek_v3", **CACHE_CASES["deepseek_v3"])
    path = _with_mtp_layer(src, tmp_path / "mtp")
    capsys.readouterr()
    llm = LLM(str(path), device_memory="25%")
    err = capsys.readouterr().err
    assert "ignoring 1 multi-token-prediction layer(s)" in err and "model.layers.{3}.*" in err, err
    assert llm.mtp_layers == [3]
    torch.testing.assert_close(llm.logits(SEQ), resident(src)[0], atol=1e-5, rtol=0)
    # the plan counts the model without them
    plan = {}
    for p in (src, path):
        assert main(["plan", str(p), "--json"]) == 0
        plan[p] = json.loads(capsys.readouterr().out)
    assert plan[path]["bytes"] == plan[src]["bytes"]
    assert plan[path]["model"]["dir_bytes"] > plan[src]["model"]["dir_bytes"]


# -- block fp8 as DeepSeek ships it ---------------------------------------------------------------------


def test_deepseek_v3_block_fp8_as_shipped(checkpoint, tmp_path):
    """Every Linear but the routers (MLA q_a/q_b/kv_a_with_mqa/kv_b/o, experts, shared experts, dense MLP)
    float8 with `weight_scale_inv` blocks of 32 (ragged at the 20-row kv_a_proj edge) == the dequantized checkpoint,
    resident and tiered, and transformers on the dequantized weights."""
    from test_quant_checkpoints import check_against_dense, ship_fp8_block

    from expertcache.quant.fp8_block import quantize_fp8_block

    src = checkpoint("deepseek_v3", **CACHE_CASES["deepseek_v3"])
    shipped = ship_fp8_block(src, tmp_path / "fp8")

    def mqa_fp8(t):  # DeepSeek ships kv_a_proj_with_mqa [R + P, H] in fp8 too
        for name in [n for n in t if n.endswith("kv_a_proj_with_mqa.weight")]:
            t[name], t[name.replace(".weight", ".weight_scale_inv")] = quantize_fp8_block(
                t[name].float(), (32, 32)
            )
        return t

    C.rewrite_tensors(shipped, mqa_fp8)
    t = C.read_tensors(shipped)
    assert t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)  # [20, 64]
    assert t["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape == (3, 1)  # [80, 16]
    assert t["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    check_against_dense(shipped, tmp_path)


# -- the hub repos' layouts -----------------------------------------------------------------------------

# config.json of the hub repos as published (fields that matter here; dims of the real models)
HUB = {
    "deepseek-ai/DeepSeek-V2-Lite": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        ep_size=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        num_experts_per_tok=6,
        moe_layer_freq=1,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        scoring_func="softmax",
        aux_loss_alpha=0.001,
        seq_aux=True,
        hidden_act="silu",
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        attention_bias=False,
        bos_token_id=100000,
        eos_token_id=100001,
        torch_dtype="bfloat16",
    ),
    "deepseek-ai/DeepSeek-V3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_nextn_predict_layers=1,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        ep_size=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        moe_layer_freq=1,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        hidden_act="silu",
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        attention_bias=False,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    ),
    "zai-org/GLM-4.5-Air": dict(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        num_nextn_predict_layers=1,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        partial_rotary_factor=0.5,
        n_shared_experts=1,
        n_routed_experts=128,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=False,
        attention_bias=True,
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=1000000,
        tie_word_embeddings=False,
        eos_token_id=[151329, 151336, 151338],
        pad_token_id=151329,
        torch_dtype="bfloat16",
    ),
    "zai-org/GLM-4.7-Flash": dict(
        architectures=["Glm4MoeLiteForCausalLM"],
        model_type="glm4_moe_lite",
        vocab_size=154880,
        hidden_size=2048,
        intermediate_size=10240,
        moe_intermediate_size=1536,
        num_hidden_layers=47,
        num_nextn_predict_layers=1,
        num_attention_heads=20,
        num_key_value_heads=20,
        n_shared_experts=1,
        n_routed_experts=64,
        routed_scaling_factor=1.8,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_rope_head_dim=64,
        v_head_dim=256,
        qk_nope_head_dim=192,
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        rope_theta=1000000,
        rope_interleave=True,
        tie_word_embeddings=False,
        eos_token_id=[154820, 154827, 154829],
        pad_token_id=154820,
        torch_dtype="bfloat16",
    ),
}
# Kimi-K2: DeepSeek-V3's architecture and tensor layout with other sizes
HUB["moonshotai/Kimi-K2-Instruct"] = {
    **HUB["deepseek-ai/DeepSeek-V3"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}
# (moe layers, routed experts, top-k, router kind, KV values per layer and token: latent or 2 x g x D)
HUB_EXPECT = {
    "deepseek-ai/DeepSeek-V2-Lite": (26, 64, 6, "softmax", 576),
    "deepseek-ai/DeepSeek-V3": (58, 256, 8, "noaux_tc", 576),
    "moonshotai/Kimi-K2-Instruct": (60, 384, 8, "noaux_tc", 576),
    "zai-org/GLM-4.5-Air": (45, 128, 8, "noaux_tc", 2 * 8 * 128),
    "zai-org/GLM-4.7-Flash": (46, 64, 4, "noaux_tc", 576),
}


@pytest.mark.parametrize("repo", sorted(HUB))
def test_hub_configs_parse(tmp_path, repo):
    (tmp_path / "config.json").write_text(json.dumps(HUB[repo]))
    family, cfg, _ = read_config(tmp_path)
    assert FAMILIES[HUB[repo]["architectures"][0]] is family
    moe, experts, top_k, kind, kv = HUB_EXPECT[repo]
    assert (len(cfg.moe_layer_ids), cfg.num_experts, cfg.top_k, cfg.router.kind) == (
        moe,
        experts,
        top_k,
        kind,
    )
    assert sum(map(lambda s: int(torch.tensor(s).prod()), cfg.kv_token_shapes)) == kv
    if cfg.mla is not None:
        assert cfg.rope_interleave and cfg.rotary_dim == 64
    if repo == "zai-org/GLM-4.5-Air":
        assert cfg.rotary_dim == 64 and cfg.qkv_bias and not cfg.o_bias and cfg.qk_norm is None


def _hub_spelling(path: Path) -> None:
    """Rewrite a tiny checkpoint's config.json the way the hub repos spell it: top-level rope_theta,
    legacy rope_scaling with `type`, scoring_func / topk_method / aux fields, torch_dtype."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:  # GLM-4.5 spells it at the top level
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    cfg.pop("dtype", None)
    cfg.update(torch_dtype="float32", ep_size=1, aux_loss_alpha=0.001, seq_aux=True, moe_layer_freq=1)
    if cfg["architectures"] != ["DeepseekV2ForCausalLM"]:
        cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
    if cfg["architectures"] == ["Glm4MoeLiteForCausalLM"]:
        cfg.update(first_k_dense_replace=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.mark.parametrize(
    "family,overrides",
    [
        (
            "deepseek_v2",
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 10000.0,
                    "mscale": 0.707,
                    "mscale_all_dim": 0.707,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
                q_lora_rank=None,
            ),
        ),
        (
            "deepseek_v3",
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 10000.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
                n_group=4,
                topk_group=2,
                n_routed_experts=16,
            ),
        ),
        (
            "glm4_moe",
            dict(
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                attention_bias=True,
                n_routed_experts=16,
            ),
        ),
        (
            "glm4_moe_lite",
            dict(n_routed_experts=16, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"]),
        ),
    ],
    ids=[
        "deepseek-v2-lite-spelling",
        "deepseek-v3-spelling",
        "glm-4.5-air-spelling",
        "glm-4.7-flash-spelling",
    ],
)
def test_hub_spelled_config_matches_transformers(checkpoint, tmp_path, family, overrides):
    path = C.copy_checkpoint(checkpoint(family, **overrides), tmp_path / "model")
    _hub_spelling(path)
    ref = C.load_reference(path)
    llm = LLM(str(path))
    torch.testing.assert_close(llm.logits(SEQ), C.reference_logits(ref, SEQ), atol=1e-4, rtol=1e-4)


# -- the DeepSeek-V3 chat template ------------------------------------------------------------------------

DS_CONVERSATIONS = {
    "system+multi-turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "<think>easy</think>Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
    "tool-calls": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "tool", "content": '{"temp": 24}'},
        {"role": "assistant", "content": "Paris 18, Rome 24."},
        {"role": "user", "content": "Thanks!"},
    ],
    "tool-output-last": [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "12:00"},
    ],
}


@pytest.fixture(scope="module")
def deepseek_chat(checkpoint, tmp_path_factory):
    from transformers import AutoTokenizer

    path = C.copy_checkpoint(
        checkpoint("deepseek_v3", **CACHE_CASES["deepseek_v3"]), tmp_path_factory.mktemp("ds-chat") / "model"
    )
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc.update(
        chat_template=(FIXTURES / "deepseek_v3_chat_template.jinja").read_text(), bos_token="<|endoftext|>"
    )
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return LLM(str(path)), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", list(DS_CONVERSATIONS))
def test_deepseek_v3_chat_template_matches_transformers(deepseek_chat, conv, add_generation_prompt):
    llm, hf = deepseek_chat
    messages = DS_CONVERSATIONS[conv]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert "<｜User｜>" in got and got.startswith("<|endoftext|>")


def test_help_lists_every_registered_architecture(capsys):
    from expertcache.cli import SUPPORTED

    listed = {line.split()[0] for line in SUPPORTED.splitlines()[1:]}
    assert listed == set(FAMILIES)
    for repo in HUB:
        assert repo in SUPPORTED
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "DeepseekV3ForCausalLM" in capsys.readouterr().out
