"""GPT-OSS against transformers' GptOssForCausalLM (fp32, eager attention), tiny random checkpoints.

Each case: full-sequence logits within 1e-4, 24 greedy tokens identical, a batch of prompts of
different lengths decoded together equal to transformers one by one, chunked prefill, and prefix
reuse. The checkpoints have sliding (window 4) and full layers, sinks, q/k/v/o biases, YaRN, a
router with bias, expert biases and the clamped SwiGLU (tests/gpt_oss_checkpoints.py). The MXFP4
case is written in the layout openai/gpt-oss-* ship and compared with transformers run on the
weights transformers' own converter dequantizes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import checkpoints as C
import gpt_oss_checkpoints as G
import pytest
import torch
from safetensors_reference import independent_slot_checks

from expertcache import LLM, SamplingParams
from expertcache.errors import CheckpointError, ConfigError
from expertcache.experts.policy import POLICIES


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


ATOL = RTOL = 1e-4
NEW_TOKENS = 24
PROMPT = torch.randint(9, G.vocab_size(), (16,), generator=torch.Generator().manual_seed(7)).tolist()
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    overrides: dict = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    mxfp4: bool = False


CASES = [
    Case("base"),  # sliding, full, sliding; sinks; biases; yarn (truncate false)
    Case(
        "rope-as-shipped",
        dict(rope_parameters=dict(G.SHIPPED_ROPE), max_position_embeddings=131072, num_hidden_layers=2),
    ),  # default layer_types
    Case("tight-clamp", dict(swiglu_limit=0.6, swiglu_alpha=1.2)),
    Case(
        "16-experts-top4-full-no-attn-bias",
        dict(
            num_local_experts=16,
            num_experts_per_tok=4,
            attention_bias=False,
            layer_types=["full_attention"] * 3,
        ),
    ),
    Case("bf16-checkpoint", dtype=torch.bfloat16),
    Case("mxfp4-as-shipped", mxfp4=True),
]


@dataclasses.dataclass
class Loaded:
    case: Case
    path: Path
    reference: object
    llm: LLM
    _greedy: dict = dataclasses.field(default_factory=dict)

    def greedy(self, prompt: list[int]) -> list[int]:
        if tuple(prompt) not in self._greedy:
            self._greedy[tuple(prompt)] = C.reference_greedy(self.reference, prompt, NEW_TOKENS)
        return self._greedy[tuple(prompt)]


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory):
    cache: dict = {}

    def build(case: Case) -> Path:
        if case.id not in cache:
            root = tmp_path_factory.mktemp(f"gpt-oss-{case.id}")
            path = G.make_gpt_oss(root, dtype=case.dtype, **case.overrides)
            cache[case.id] = G.to_shipped_mxfp4(path, root / "mxfp4") if case.mxfp4 else path
            cache[case.id, "fp32"] = path
        return cache[case.id]

    build.fp32 = lambda case: cache[case.id, "fp32"]
    return build


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def loaded(request, gpt_oss_dir):
    case = request.param
    path = gpt_oss_dir(case)
    ref = G.dequantized_reference(path, gpt_oss_dir.fp32(case)) if case.mxfp4 else C.load_reference(path)
    llm = LLM(str(path), device="cpu")
    yield Loaded(case, path, ref, llm)
    llm.close()


def test_logits_match_transformers(loaded):
    expected = C.reference_logits(loaded.reference, PROMPT)
    got = loaded.llm.logits(PROMPT)
    torch.testing.assert_close(
        got,
        expected,
        atol=ATOL,
        rtol=RTOL,
        msg=lambda m: f"{loaded.case.id}: logits differ from transformers\n{m}",
    )


def test_greedy_matches_transformers(loaded):
    out = loaded.llm.generate([PROMPT], GREEDY)[0]
    assert list(out.token_ids) == loaded.greedy(PROMPT), loaded.case.id


def test_batch_equals_one_by_one(loaded):
    prompts = [PROMPT, PROMPT[:5], PROMPT[5:] + PROMPT]
    batched = [list(o.token_ids) for o in loaded.llm.generate(prompts, GREEDY)]
    alone = [list(loaded.llm.generate([p], GREEDY)[0].token_ids) for p in prompts]
    assert batched == alone
    assert batched == [loaded.greedy(p) for p in prompts]


def test_chunked_prefill_matches_transformers(loaded):
    llm = LLM(str(loaded.path), device="cpu", max_num_batched_tokens=5, max_num_seqs=2, prefix_caching=False)
    torch.testing.assert_close(
        llm.logits(PROMPT), C.reference_logits(loaded.reference, PROMPT), atol=ATOL, rtol=RTOL
    )
    prompts = [PROMPT, PROMPT[:5], PROMPT[5:] + PROMPT]
    assert [list(o.token_ids) for o in llm.generate(prompts, GREEDY)] == [loaded.greedy(p) for p in prompts]


def test_prefix_reuse_matches_transformers(loaded):
    """Prompts sharing a 36-token prefix: the second and later reuse the first one's cached KV
    blocks (sliding-window layers included) and still decode transformers' tokens."""
    common = PROMPT + PROMPT[::-1] + PROMPT[:4]
    prompts = [common + [11, 12], common + [13], common[:33] + [14, 15, 16]]
    for p in prompts:
        out = loaded.llm.generate([p], GREEDY)[0]
        assert list(out.token_ids) == loaded.greedy(p)
    again = loaded.llm.generate([prompts[0]], GREEDY)[0]
    assert again.num_cached_tokens >= 32 and list(again.token_ids) == loaded.greedy(prompts[0])


# --------------------------------------------------------------------------------------------
# the test cases exercise every feature: switching one off in the reference changes the logits


def _perturbed_logits(model, edit) -> torch.Tensor:
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            edit(model)
        return C.reference_logits(model, PROMPT)
    finally:
        model.load_state_dict(saved)


FEATURES = {
    "sinks": lambda m: [layer.self_attn.sinks.fill_(-1e4) for layer in m.model.layers],
    "router bias": lambda m: [layer.mlp.router.bias.zero_() for layer in m.model.layers],
    "expert biases": lambda m: [
        (layer.mlp.experts.gate_up_proj_bias.zero_(), layer.mlp.experts.down_proj_bias.zero_())
        for layer in m.model.layers
    ],
    "attention biases": lambda m: [layer.self_attn.o_proj.bias.zero_() for layer in m.model.layers],
    "sliding window": lambda m: [
        setattr(layer.self_attn, "sliding_window", None)
        or m.config.layer_types.__setitem__(i, "full_attention")
        for i, layer in enumerate(m.model.layers)
    ],
    "swiglu clamp": lambda m: [setattr(layer.mlp.experts, "limit", 1e9) for layer in m.model.layers],
    "gate/up interleaving": lambda m: [
        layer.mlp.experts.gate_up_proj.copy_(
            layer.mlp.experts.gate_up_proj.view(*layer.mlp.experts.gate_up_proj.shape[:2], -1, 2)
            .transpose(-1, -2)
            .reshape(layer.mlp.experts.gate_up_proj.shape)
        )
        for layer in m.model.layers
    ],
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_changes_the_logits(gpt_oss_dir, feature):
    case = CASES[0] if feature != "swiglu clamp" else CASES[2]
    model = C.load_reference(gpt_oss_dir(case))
    base = C.reference_logits(model, PROMPT)
    layer_types = list(model.config.layer_types)
    try:
        changed = _perturbed_logits(model, FEATURES[feature])
    finally:
        model.config.layer_types = layer_types
    assert (changed - base).abs().max() > 1e-2, f"{feature} does not change the test model's logits"


def test_mxfp4_is_not_the_fp32_model(gpt_oss_dir):
    """Guard: the MXFP4 reference differs from the fp32 model it was quantized from (so matching it
    checks the MXFP4 decoding, not the fp32 weights)."""
    case = CASES[-1]
    dq = C.reference_logits(G.dequantized_reference(gpt_oss_dir(case), gpt_oss_dir.fp32(case)), PROMPT)
    assert (dq - C.reference_logits(C.load_reference(gpt_oss_dir.fp32(case)), PROMPT)).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------
# the expert cache with biases and MXFP4: tight budgets give the resident output


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def cache_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-cache")
    path = G.make_gpt_oss(root, dtype=torch.bfloat16, num_local_experts=16, num_experts_per_tok=2)
    if request.param == "mxfp4":
        path = G.to_shipped_mxfp4(path, root / "mxfp4")
    llm = LLM(str(path))
    prompts = [PROMPT, PROMPT[:3], PROMPT[::-1] + PROMPT]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = {
        "logits": llm.logits(PROMPT + PROMPT),
        "tokens": [list(o.token_ids) for o in llm.generate(prompts, params)],
    }
    llm.close()
    return path, prompts, params, ref


def _cached_run(cache_model, **kw):
    path, prompts, params, ref = cache_model
    llm = LLM(str(path), verify=True, **kw)
    try:
        logits = llm.logits(PROMPT + PROMPT)
        toks = [list(o.token_ids) for o in llm.generate(prompts, params)]
        llm.experts.check(contents=True)
        stats = llm.expert_stats()
    finally:
        llm.close()
    torch.testing.assert_close(logits, ref["logits"], atol=1e-4, rtol=1e-4)
    assert toks == ref["tokens"]
    return stats


@pytest.mark.parametrize("policy", sorted(p for p in POLICIES if p != "min"))
def test_device_host_disk_tiers_give_resident_output(cache_model, policy):
    """2 of 16 experts per layer in the fastest tier, 3 in host RAM, the rest read from disk."""
    stats = _cached_run(cache_model, device_memory="13%", host_memory="19%", cache_policy=policy)
    assert stats["per_tier"]["disk"]["bytes_read"] > 0 and stats["misses"] > 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(cpu_compute="always"),
        dict(prefetch="device"),
        dict(overlap_io=False),
        dict(low_memory=True, host_memory=0),
        dict(low_memory=True, host_memory="19%"),
    ],
    ids=["cpu-compute", "prefetch-device", "sync-reads", "low-memory-no-host", "low-memory"],
)
def test_cache_modes_give_resident_output(cache_model, kw):
    _cached_run(cache_model, **{"device_memory": "13%", "host_memory": "19%", **kw})


# --------------------------------------------------------------------------------------------
# config fields, stop tokens, plan


def test_config_fields(gpt_oss_dir):
    from expertcache.models.registry import read_config

    _, cfg, _ = read_config(gpt_oss_dir(CASES[0]))
    assert cfg.family == "gpt_oss" and cfg.sliding_window == (4, None, 4)
    assert cfg.attn_sinks and cfg.router_bias and cfg.expert_bias and cfg.qkv_bias and cfg.o_bias
    assert (cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.router.kind) == (
        "clamped_swiglu",
        1.702,
        7.0,
        "topk_softmax",
    )
    assert cfg.eos_token_ids == G.EOS_IDS  # generation_config.json


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"], "chunked_attention"),
        ("layer_types", ["full_attention"], "layer_types has 1 entries"),
        ("sliding_window", None, "sliding_window is null"),
        ("swiglu_limit", "7", "swiglu_limit"),
        ("swiglu_alpha", None, "swiglu_alpha"),
        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
        ("quantization_config", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ],
)
def test_bad_config_is_a_clear_error(gpt_oss_dir, tmp_path, field, value, match):
    path = C.copy_checkpoint(gpt_oss_dir(CASES[0]), tmp_path / "m")
    C.edit_config(path, **{field: value})
    with pytest.raises(ConfigError, match=match):
        LLM(str(path))


def test_missing_expert_bias_is_a_clear_error(gpt_oss_dir, tmp_path):
    path = C.copy_checkpoint(gpt_oss_dir(CASES[0]), tmp_path / "m")
    C.rewrite_tensors(
        path, lambda t: {k: v for k, v in t.items() if not k.endswith("layers.1.mlp.experts.down_proj_bias")}
    )
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj_bias"):
        LLM(str(path))


def test_stops_at_generation_config_eos(gpt_oss_dir, tmp_path):
    """Every id of generation_config.json's eos_token_id list ends a request (GPT-OSS ships three:
    <|return|>, <|endoftext|>, <|call|>); here the list's middle entry is made a token the model
    greedily emits, so the request must stop there."""
    path = C.copy_checkpoint(gpt_oss_dir(CASES[0]), tmp_path / "m")
    free = list(LLM(str(path)).generate([PROMPT], GREEDY)[0].token_ids)
    n = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)
    C.write_generation_config(path, eos_token_id=[G.RETURN, free[n], G.CALL])
    llm = LLM(str(path))
    assert set(llm.engine.eos) >= {G.RETURN, free[n], G.CALL}
    out = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))[0]
    assert out.finish_reason == "stop" and list(out.token_ids) == free[: n + 1]
    llm.close()


def test_quantize_command_refuses_gpt_oss(gpt_oss_dir, tmp_path):
    from expertcache.quantize.rewrite import quantize_checkpoint

    with pytest.raises(ValueError, match="gpt_oss experts .* cannot be rewritten"):
        quantize_checkpoint(gpt_oss_dir(CASES[0]), tmp_path / "q", "int8")
