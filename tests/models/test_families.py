"""Every model family and every config field that changes the math, checked against transformers.

For each case: full-sequence fp32 logits match transformers (eager attention, fp32) to 1e-4,
greedy generation of 24 tokens is token-identical to `generate(do_sample=False)`, and the same
checkpoint rewritten into the fused expert layout gives the same logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import checkpoints as C
import pytest
import torch

ATOL = 1e-4
RTOL = 1e-4
PROMPT_LEN = 16
NEW_TOKENS = 24
PROMPT = torch.randint(
    3, C.tokenizer_vocab_size(), (PROMPT_LEN,), generator=torch.Generator().manual_seed(1234)
).tolist()


def _hub_style_config(path: Path) -> None:
    """Rewrite config.json the way Qwen3-MoE checkpoints on the hub spell it (transformers 4.x):
    `num_experts` (transformers 5 writes `num_local_experts`), top-level `rope_theta` and a
    legacy `rope_scaling` with `type` instead of `rope_parameters`."""
    import json

    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _drop_yarn_original(path: Path) -> None:
    import json

    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_scaling"]["original_max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    family: str
    overrides: dict = dataclasses.field(default_factory=dict)
    build: dict = dataclasses.field(default_factory=dict)  # make_checkpoint kwargs (dtype, shards)
    edit: object = None  # callable(path) applied to a copy of the checkpoint


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
# DeepSeek's YaRN: mscale != mscale_all_dim, so the cos/sin factor and the softmax scale both change
DS_YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
    "beta_fast": 32,
    "beta_slow": 1,
}

CASES = [
    # --- Qwen3-MoE: GQA (4 q heads / 2 kv heads), per-head q/k RMSNorm, norm_topk_prob=True
    Case("qwen3-base", "qwen3_moe"),
    Case("qwen3-no-norm-topk", "qwen3_moe", dict(norm_topk_prob=False, num_experts_per_tok=3)),
    Case("qwen3-16-experts-top4", "qwen3_moe", dict(num_experts=16, num_experts_per_tok=4)),
    Case("qwen3-head-dim-32", "qwen3_moe", dict(head_dim=32)),  # head_dim != hidden / heads (16)
    Case("qwen3-mqa", "qwen3_moe", dict(num_key_value_heads=1, head_dim=8)),
    Case("qwen3-mha", "qwen3_moe", dict(num_key_value_heads=4)),
    Case(
        "qwen3-rope-theta", "qwen3_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    ),
    Case(
        "qwen3-rope-linear",
        "qwen3_moe",
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ),
    Case("qwen3-rope-yarn", "qwen3_moe", dict(rope_parameters=dict(YARN))),
    Case("qwen3-rms-eps", "qwen3_moe", dict(rms_norm_eps=0.1)),
    Case("qwen3-tied-embeddings", "qwen3_moe", dict(tie_word_embeddings=True)),
    Case("qwen3-attention-bias", "qwen3_moe", dict(attention_bias=True)),
    Case("qwen3-mlp-only-layers", "qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0, 2])),
    Case("qwen3-decoder-sparse-step", "qwen3_moe", dict(num_hidden_layers=3, decoder_sparse_step=2)),
    Case("qwen3-sliding-window", "qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),
    # checkpoint formats: hub-style config.json, bf16 tensors (fp32 compute), sharded files
    Case("qwen3-hub-config", "qwen3_moe", edit=_hub_style_config),
    Case("qwen3-hub-config-yarn", "qwen3_moe", dict(rope_parameters=dict(YARN)), edit=_hub_style_config),
    # yarn without original_max_position_embeddings: transformers falls back to max_position_embeddings
    Case(
        "qwen3-hub-config-yarn-no-original",
        "qwen3_moe",
        dict(rope_parameters=dict(YARN)),
        edit=lambda p: (_hub_style_config(p), _drop_yarn_original(p)),
    ),
    Case("qwen3-bf16-checkpoint", "qwen3_moe", build=dict(dtype=torch.bfloat16)),
    Case("qwen3-sharded", "qwen3_moe", build=dict(max_shard_size="100KB")),
    # --- Qwen2-MoE: shared expert with sigmoid gate, q/k/v bias, norm_topk_prob=False
    Case("qwen2-base", "qwen2_moe"),
    Case("qwen2-norm-topk", "qwen2_moe", dict(norm_topk_prob=True)),
    Case("qwen2-no-qkv-bias", "qwen2_moe", dict(qkv_bias=False)),
    Case("qwen2-mlp-only-layers", "qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    Case("qwen2-decoder-sparse-step", "qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),
    # transformers' layer_types: sliding on even layers below max_window_layers (here layer 0 only)
    Case(
        "qwen2-sliding-window",
        "qwen2_moe",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=2),
    ),
    # --- Mixtral: block_sparse_moe w1/w2/w3, top-2 with renormalised weights
    Case("mixtral-base", "mixtral"),
    Case("mixtral-sliding-window", "mixtral", dict(sliding_window=4)),
    Case("mixtral-head-dim-32", "mixtral", dict(head_dim=32, num_key_value_heads=1)),
    # --- OLMoE: q/k RMSNorm over the whole projection, clip_qkv, norm_topk_prob=False
    Case("olmoe-base", "olmoe"),
    Case("olmoe-clip-qkv", "olmoe", dict(clip_qkv=0.5)),
    Case("olmoe-norm-topk", "olmoe", dict(norm_topk_prob=True)),
    # --- DeepSeek-V2: MLA with q_lora_rank, softmax greedy top-k, routed_scaling_factor, shared expert,
    # first layer dense (interleaved rotary pairs)
    Case("deepseek-v2-base", "deepseek_v2"),
    Case(
        "deepseek-v2-no-q-lora-group-limited",
        "deepseek_v2",
        dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    Case(
        "deepseek-v2-yarn-mscale",
        "deepseek_v2",
        dict(rope_parameters=dict(DS_YARN), num_hidden_layers=3, first_k_dense_replace=2, n_shared_experts=2),
    ),
    # --- DeepSeek-V3: sigmoid + e_score_correction_bias, 2 groups keep 1, norm_topk_prob, dense first layer
    Case("deepseek-v3-base", "deepseek_v3"),
    Case(
        "deepseek-v3-groups-yarn",
        "deepseek_v3",
        dict(
            n_group=4, topk_group=2, num_experts_per_tok=3, num_hidden_layers=3, rope_parameters=dict(DS_YARN)
        ),
    ),
    Case(
        "deepseek-v3-no-interleave-no-norm",
        "deepseek_v3",
        dict(rope_interleave=False, norm_topk_prob=False, q_lora_rank=None, attention_bias=True),
    ),
    # --- GLM-4.5: partial rotary (0.5), attention bias, q/k norm on/off, V3 routing, dense first layer
    Case("glm4-moe-base", "glm4_moe"),
    Case("glm4-moe-qk-norm-bias", "glm4_moe", dict(use_qk_norm=True, attention_bias=True)),
    Case(
        "glm4-moe-groups-rotary",
        "glm4_moe",
        dict(
            n_group=2,
            topk_group=1,
            num_hidden_layers=3,
            first_k_dense_replace=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
        ),
    ),
    # --- GLM-4.7-Flash class: MLA + GLM routing, mlp_layer_types dense first
    Case("glm4-moe-lite-base", "glm4_moe_lite"),
    Case(
        "glm4-moe-lite-no-q-lora-3-layers",
        "glm4_moe_lite",
        dict(q_lora_rank=None, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"]),
    ),
]


@dataclasses.dataclass
class Loaded:
    case: Case
    path: Path
    reference: object  # transformers model
    llm: object
    prompt: list[int]
    _greedy: dict = dataclasses.field(default_factory=dict)

    def reference_greedy(self, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._greedy:
            self._greedy[key] = C.reference_greedy(self.reference, prompt, n)
        return self._greedy[key]

    def batch_prompts(self) -> list[list[int]]:
        """Three prompts of lengths 16, 5 and 27 for the batching tests."""
        return [self.prompt, self.prompt[:5], self.prompt[5:] + self.prompt]


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def loaded(request, checkpoint, expertcache_api, tmp_path_factory):
    case: Case = request.param
    path = checkpoint(case.family, **case.build, **case.overrides)
    if case.edit is not None:
        path = C.copy_checkpoint(path, tmp_path_factory.mktemp(case.id) / "model")
        case.edit(path)
    reference = C.load_reference(path, dtype=torch.float32)
    llm = expertcache_api.LLM(str(path), device="cpu", cpu_math="exact")
    prompt = PROMPT
    yield Loaded(case, path, reference, llm, prompt)
    del llm


reference_logits = C.reference_logits
reference_greedy = C.reference_greedy


def _first_mismatch(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_logits_match_transformers(loaded):
    expected = reference_logits(loaded.reference, loaded.prompt)
    got = loaded.llm.logits(loaded.prompt)
    assert isinstance(got, torch.Tensor)
    assert got.dtype == torch.float32
    assert tuple(got.shape) == tuple(expected.shape), f"{loaded.case.id}: logits shape"
    diff = (got - expected).abs().max(dim=-1).values
    torch.testing.assert_close(
        got,
        expected,
        atol=ATOL,
        rtol=RTOL,
        msg=lambda m: (
            f"{loaded.case.id}: logits differ from transformers; max |diff| per position "
            f"{[round(float(d), 6) for d in diff]}\n{m}"
        ),
    )


def check_greedy(loaded, prompt, got, what=""):
    expected = loaded.reference_greedy(prompt)
    got = list(got)
    if got != expected:
        i = _first_mismatch(got, expected)
        ctx = prompt + expected[:i]
        top = reference_logits(loaded.reference, ctx)[-1].topk(2)
        margin = float(top.values[0] - top.values[1])
        pytest.fail(
            f"{loaded.case.id}{what}: greedy tokens for a {len(prompt)}-token prompt differ from "
            "transformers "
            f"at step {i}: engine {got[i : i + 4]} vs transformers {expected[i : i + 4]} "
            f"(transformers' top-2 margin there {margin:.2e})\nengine       {got}\ntransformers {expected}"
        )


def greedy_params(api):
    return api.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_matches_transformers(loaded, expertcache_api):
    out = loaded.llm.generate([loaded.prompt], greedy_params(expertcache_api))[0]
    check_greedy(loaded, loaded.prompt, out.token_ids)
    assert out.finish_reason == "length"
    assert list(out.prompt_token_ids) == loaded.prompt


def test_batched_greedy_matches_transformers(loaded, expertcache_api):
    """Prompts of different lengths decoded together (continuous batching)."""
    prompts = loaded.batch_prompts()
    outs = loaded.llm.generate(prompts, greedy_params(expertcache_api))
    for prompt, out in zip(prompts, outs):
        check_greedy(loaded, prompt, out.token_ids, " (batched)")


def test_chunked_prefill_matches_transformers(loaded, expertcache_api):
    """A 5-token step budget splits every prefill into chunks and interleaves them with decodes;
    max_num_seqs=2 queues the third prompt; no prefix cache."""
    llm = expertcache_api.LLM(
        str(loaded.path),
        device="cpu",
        cpu_math="exact",
        max_num_batched_tokens=5,
        max_num_seqs=2,
        prefix_caching=False,
    )
    torch.testing.assert_close(
        llm.logits(loaded.prompt),
        reference_logits(loaded.reference, loaded.prompt),
        atol=ATOL,
        rtol=RTOL,
        msg=lambda m: f"{loaded.case.id} (chunked logits): {m}",
    )
    prompts = loaded.batch_prompts()
    outs = llm.generate(prompts, greedy_params(expertcache_api))
    for prompt, out in zip(prompts, outs):
        check_greedy(loaded, prompt, out.token_ids, " (chunked prefill, batched)")


def test_fused_expert_layout_same_logits(loaded, expertcache_api, tmp_path):
    fused = C.to_fused_layout(loaded.path, tmp_path / "fused")
    names = C.tensor_files(fused)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in names) or not any(
        ".experts." in k for k in C.tensor_files(loaded.path)
    )
    llm = expertcache_api.LLM(str(fused), device="cpu", cpu_math="exact")
    got = llm.logits(loaded.prompt)
    expected = reference_logits(loaded.reference, loaded.prompt)
    torch.testing.assert_close(
        got, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{loaded.case.id} (fused layout): {m}"
    )
    torch.testing.assert_close(
        got,
        loaded.llm.logits(loaded.prompt),
        atol=1e-5,
        rtol=1e-5,
        msg=lambda m: f"{loaded.case.id}: fused vs per-expert layout: {m}",
    )


_base_logits: dict[str, torch.Tensor] = {}


def test_variant_changes_the_math(loaded, checkpoint):
    """Guard for the test itself: a variant's logits differ from its family's base model (same
    seed, so the same weights where shapes agree); a field the engine ignored would then fail
    test_logits_match_transformers instead of passing unnoticed."""
    fam = loaded.case.family
    if fam not in _base_logits:
        _base_logits[fam] = reference_logits(C.load_reference(checkpoint(fam)), loaded.prompt)
    variant = reference_logits(loaded.reference, loaded.prompt)
    base = _base_logits[fam]
    if not loaded.case.overrides:  # checkpoint-format case: the same model as the base, stored differently
        tol = 0.5 if loaded.case.build.get("dtype") == torch.bfloat16 else 1e-5
        torch.testing.assert_close(variant, base, atol=tol, rtol=0)
    elif variant.shape == base.shape:
        assert (variant - base).abs().max() > 1e-2, f"{loaded.case.id}: variant does not change the logits"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case_id",
    [
        "qwen3-base",
        "qwen3-sliding-window",
        "qwen2-base",
        "mixtral-base",
        "olmoe-clip-qkv",
        "deepseek-v2-no-q-lora-group-limited",
        "deepseek-v3-groups-yarn",
        "glm4-moe-qk-norm-bias",
        "glm4-moe-lite-base",
    ],
)
def test_cuda_fp32_matches_transformers(case_id, checkpoint, expertcache_api):
    """On CUDA in fp32 the engine matches transformers' CPU fp32 logits and greedy tokens."""
    case = next(c for c in CASES if c.id == case_id)
    path = checkpoint(case.family, **case.build, **case.overrides)
    reference = C.load_reference(path)
    llm = expertcache_api.LLM(str(path), device="cuda", dtype="float32")
    got = llm.logits(PROMPT)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    torch.testing.assert_close(got, reference_logits(reference, PROMPT), atol=2e-3, rtol=2e-3)
    out = llm.generate([PROMPT], greedy_params(expertcache_api))[0]
    assert list(out.token_ids) == C.reference_greedy(reference, PROMPT, NEW_TOKENS)
