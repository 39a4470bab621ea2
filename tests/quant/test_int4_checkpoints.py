"""GPTQ, AWQ and compressed-tensors checkpoints as shipped, against their dequantized twins.

Each checkpoint is written by the packers of tests/int4_packers.py (from the formats' documentation,
not from the engine's readers): routed experts and attention projections quantized, the router and
lm_head left as bf16. Its twin is the same model with every quantized weight replaced by the float
weight its codes stand for. Checked: logits within float32 summation noise of the twin's (the engine
on the twin, and transformers on the twin as an independent oracle), greedy tokens identical, in
every tier (resident, a partial host tier with every fill compared to the checkpoint, --low-memory
streaming from disk); the tiers hold int4/int8 (repacked), or the shipped tensors for act-order
GPTQ; checkpoints whose tensors contradict their config are errors naming the tensor; `plan`
counts the shipped bytes.
"""

from __future__ import annotations

import json

import checkpoints
import int4_packers as packers
import pytest
import torch

from expertcache import LLM, SamplingParams, kernels
from expertcache.config import EngineConfig
from expertcache.errors import CheckpointError, ConfigError
from expertcache.plan.model import model_sizes, read_model

H, I, E, L, K = 64, 48, 16, 2, 2
TINY = dict(
    dtype=torch.bfloat16,
    hidden_size=H,
    moe_intermediate_size=I,
    num_experts=E,
    num_hidden_layers=L,
    num_experts_per_tok=K,
)
SEQ = [(i * 37 + 11) % 300 + 3 for i in range(40)]
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], list(range(100, 130))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

# name -> (format, quantization_config, packer params, the tiers' method)
CASES = {
    "gptq4-g16-asym": (
        "gptq",
        dict(quant_method="gptq", bits=4, group_size=16, sym=False, desc_act=False),
        dict(bits=4, group_size=16, sym=False),
        "int4",
    ),
    "gptq4-channel-sym-v2": (
        "gptq",
        dict(
            quant_method="gptq", bits=4, group_size=-1, sym=True, desc_act=False, checkpoint_format="gptq_v2"
        ),
        dict(bits=4, group_size=-1, sym=True, v2=True),
        "int4",
    ),
    "gptq4-g32-ragged": (
        "gptq",
        dict(quant_method="gptq", bits=4, group_size=32, sym=False, desc_act=False),
        dict(bits=4, group_size=32, sym=False),
        "int4",
    ),  # down_proj: 48 columns, 2 groups
    "gptq8-asym-v2": (
        "gptq",
        dict(
            quant_method="gptq", bits=8, group_size=16, sym=False, desc_act=False, checkpoint_format="gptq_v2"
        ),
        dict(bits=8, group_size=16, sym=False, v2=True),
        "gptq",
    ),  # no exact int8: kept as shipped
    "gptq8-g16-sym": (
        "gptq",
        dict(quant_method="gptq", bits=8, group_size=16, sym=True, desc_act=False),
        dict(bits=8, group_size=16, sym=True),
        "int8",
    ),
    "gptq4-act-order": (
        "gptq",
        dict(quant_method="gptq", bits=4, group_size=16, sym=False, desc_act=True),
        dict(bits=4, group_size=16, sym=False, desc_act=True),
        "gptq",
    ),
    "gptq4-static-groups": (
        "gptq",
        dict(quant_method="gptq", bits=4, group_size=16, sym=False, desc_act=True, static_groups=True),
        dict(bits=4, group_size=16, sym=False),
        "int4",
    ),  # act-order, groups in order
    "awq-g16": (
        "awq",
        dict(quant_method="awq", bits=4, group_size=16, zero_point=True, version="gemm"),
        dict(group_size=16),
        "int4",
    ),
    "ct-w4a16-g16": (
        "compressed-tensors",
        dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            ignore=["lm_head", "re:.*mlp.gate$"],
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
                }
            },
        ),
        dict(bits=4, group_size=16, symmetric=True),
        "int4",
    ),
    "ct-w4a16-channel-asym": (
        "compressed-tensors",
        dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            ignore=["lm_head", "re:.*mlp.gate$"],
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
                }
            },
        ),
        dict(bits=4, group_size=-1, symmetric=False),
        "int4",
    ),
    "ct-w8a16-g16": (
        "compressed-tensors",
        dict(
            quant_method="compressed-tensors",
            format="pack-quantized",
            ignore=["lm_head", "re:.*mlp.gate$"],
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=16),
                }
            },
        ),
        dict(bits=8, group_size=16, symmetric=True),
        "int8",
    ),
}
TIERS = {
    "resident": {},
    "tiered": dict(device_memory="13%", host_memory="13%", cache_policy="lru", verify=True),
    "low-memory": dict(low_memory=True, device_memory="13%", host_memory=0, verify=True),
}


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("qwen3_moe", **TINY)


@pytest.fixture(scope="module")
def written(base, tmp_path_factory):
    """case -> (quantized dir, twin dir), built on first use."""
    root = tmp_path_factory.mktemp("int4-shipped")
    cache = {}

    def get(case):
        if case not in cache:
            fmt, qconfig, params, _ = CASES[case]
            cache[case] = packers.write(base, root / case, fmt, qconfig, params)
        return cache[case]

    return get


@pytest.fixture(scope="module")
def twin_results(written):
    """case -> (engine logits on SEQ, greedy tokens) of the dequantized twin."""
    cache = {}

    def get(case):
        if case not in cache:
            llm = LLM(str(written(case)[1]))
            cache[case] = (llm.logits(SEQ), [o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
            llm.close()
        return cache[case]

    return get


def expert_stored_bytes(qdir, layer=0, j=0) -> int:
    tensors = checkpoints.read_tensors(qdir)
    return sum(t.nbytes for n, t in tensors.items() if n.startswith(f"model.layers.{layer}.mlp.experts.{j}."))


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dequantized_twin(case, tier, written, twin_results):
    qdir, _ = written(case)
    twin_logits, twin_tokens = twin_results(case)
    llm = LLM(str(qdir), **TIERS[tier])
    try:
        assert llm.source.method.name == CASES[case][3]
        # every tier holds the compact layout: int4 codes two per byte / int8 / the shipped int32 words
        pools = (
            [llm.experts.dev.buf, llm.experts.host.buf]
            if tier != "resident"
            else [llm.experts.pools[layer] for layer in llm.source.layers]
        )
        bits = CASES[case][2].get("bits", 4)
        want = {
            "int4": (torch.uint8, (E, I, H // 2)),
            "int8": (torch.int8, (E, I, H)),
            "gptq": (torch.int32, (E, H * bits // 32, I)),
        }[CASES[case][3]]  # qweight [K/p, N]
        key = "gate.qweight" if CASES[case][3] == "gptq" else "gate.weight"
        for pool in pools:
            t = pool[key]
            assert (t.dtype, tuple(t.shape[-2:])) == (want[0], want[1][1:])
        if tier == "resident" and kernels.backend() == "cpp":  # repacked experts run on the int4/int8 kernels
            assert (llm.experts.kernel_moe_args(0, H) is not None) == (CASES[case][3] != "gptq")
        logits = llm.logits(SEQ)
        torch.testing.assert_close(logits, twin_logits, atol=2e-5 * twin_logits.abs().max().item(), rtol=0)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == twin_tokens
        if tier == "tiered":
            assert llm.experts.device_slots < E and llm.experts.host_slots < E, llm.plan_lines
    finally:
        llm.close()


@pytest.mark.parametrize("case", ["gptq4-g16-asym", "gptq4-act-order", "awq-g16", "ct-w4a16-channel-asym"])
def test_twin_matches_transformers(case, written, twin_results):
    """The oracle: transformers on the dequantized twin agrees with the engine on the quantized checkpoint."""
    ref = checkpoints.load_reference(written(case)[1])
    llm = LLM(str(written(case)[0]))
    try:
        torch.testing.assert_close(
            llm.logits(SEQ), checkpoints.reference_logits(ref, SEQ), atol=1e-4, rtol=1e-4
        )
        assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == checkpoints.reference_greedy(
            ref, PROMPTS[0], 12
        )
    finally:
        llm.close()


def test_quantization_visibly_changes_the_model(written, twin_results, base):
    """The twins differ from the bf16 model: the comparisons above see the quantized weights."""
    full = LLM(str(base)).logits(SEQ)
    assert (full - twin_results("gptq4-g16-asym")[0]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["gptq4-g16-asym", "awq-g16", "ct-w4a16-channel-asym", "gptq4-act-order"])
def test_plan_counts_the_shipped_bytes(case, written):
    qdir, _ = written(case)
    sizes = model_sizes(read_model(qdir), EngineConfig.from_kwargs(device="cpu"))
    one = expert_stored_bytes(qdir)
    assert sizes.expert_stored == one == expert_stored_bytes(qdir, L - 1, E - 1)
    assert sizes.experts_stored == one * L * E
    total = sum(t.nbytes for t in checkpoints.read_tensors(qdir).values())
    assert sizes.dense_stored == total - one * L * E
    assert sizes.stored_dtype == CASES[case][0]
    # the fastest tier: int4 by the layout legend (codes N*K/2, fp32 scale + uint8 zero per row and group)
    # for the repacked layouts, the shipped bytes for act-order GPTQ
    if CASES[case][3] == "int4":
        G = CASES[case][2].get("group_size", -1)
        one_proj = lambda N, K: N * K // 2 + N * (1 if G == -1 else -(-K // G)) * 5  # noqa: E731
        assert sizes.expert_fast == 2 * one_proj(I, H) + one_proj(H, I)
        assert sizes.fast_format == f"int4, repacked from {CASES[case][0]}"
    else:
        assert sizes.expert_fast == one


def test_exclusions_and_per_module_overrides(base, tmp_path):
    """GPTQ: modules_to_not_convert leaves layer 0's q_proj bf16, GPTQModel's dynamic makes every v_proj
    8-bit; compressed-tensors: two config groups by regex (o_proj 8-bit first, then experts and
    attention 4-bit; the router and lm_head match none), `ignore` leaves k_proj."""

    def gptq_params(module):
        if module == "model.layers.0.self_attn.q_proj":
            return None
        return (
            dict(bits=8, group_size=16, sym=True)
            if module.endswith("v_proj")
            else dict(bits=4, group_size=16)
        )

    gq = dict(
        quant_method="gptq",
        bits=4,
        group_size=16,
        sym=False,
        desc_act=False,
        modules_to_not_convert=["model.layers.0.self_attn.q_proj"],
        dynamic={r"+:.*v_proj": {"bits": 8, "sym": True}},
    )

    def ct_params(module):
        if module.endswith("k_proj"):
            return None
        return dict(bits=8, group_size=16) if module.endswith("o_proj") else dict(bits=4, group_size=16)

    cq = dict(
        quant_method="compressed-tensors",
        format="pack-quantized",
        ignore=["lm_head", "re:.*mlp.gate$", "re:.*k_proj$"],
        config_groups={
            "g8": {
                "targets": ["re:.*o_proj$"],
                "weights": dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=16),
            },
            "g4": {
                "targets": ["re:.*experts.*", "re:.*self_attn.*"],
                "weights": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
            },
        },
    )
    for fmt, qconfig, params_for in (("gptq", gq, gptq_params), ("compressed-tensors", cq, ct_params)):
        qdir, twin = packers.write(base, tmp_path / fmt, fmt, qconfig, None, params_for=params_for)
        llm, ref = LLM(str(qdir)), LLM(str(twin))
        torch.testing.assert_close(llm.logits(SEQ), ref.logits(SEQ), atol=1e-4, rtol=0)


def _edit(qdir, tmp_path, name, tensors_fn=None, **qconfig):
    dst = checkpoints.copy_checkpoint(qdir, tmp_path / name)
    if tensors_fn is not None:
        checkpoints.rewrite_tensors(dst, tensors_fn)
    if qconfig:
        hf = json.loads((dst / "config.json").read_text())
        hf["quantization_config"].update(qconfig)
        (dst / "config.json").write_text(json.dumps(hf))
    return dst


EXPERT0 = "model.layers.0.mlp.experts.0"


def test_layouts_that_lie_are_errors_naming_the_tensor(written, tmp_path):
    qdir, _ = written("gptq4-g16-asym")
    # bits 8 in the config, 4-bit tensors on disk
    with pytest.raises(
        CheckpointError, match=r"experts\.0\.gate_proj\.qweight is torch.int32 \[8, 48\].*bits 8"
    ):
        LLM(str(_edit(qdir, tmp_path, "bits", bits=8)))

    # a missing qzeros
    def drop_zeros(t):
        t.pop(f"{EXPERT0}.down_proj.qzeros")
        return t

    with pytest.raises(CheckpointError, match=rf"missing tensor {EXPERT0}\.down_proj\.qzeros"):
        LLM(str(_edit(qdir, tmp_path, "qzeros", drop_zeros)))

    # a g_idx of the wrong length
    def short_gidx(t):
        t[f"{EXPERT0}.up_proj.g_idx"] = t[f"{EXPERT0}.up_proj.g_idx"][:-1].clone()
        return t

    with pytest.raises(CheckpointError, match=rf"{EXPERT0}\.up_proj\.g_idx is torch.int32 \[63\]"):
        LLM(str(_edit(qdir, tmp_path, "gidx", short_gidx)))
    # act-order groups in a checkpoint whose config says desc_act false: named at the expert's read
    act, _ = written("gptq4-act-order")
    with pytest.raises(CheckpointError, match=rf"{EXPERT0}\.gate_proj\.g_idx does not put column k in group"):
        LLM(str(_edit(act, tmp_path, "order", desc_act=False)))

    # a dense module's tensors are checked the same way
    def short_dense(t):
        t["model.layers.1.self_attn.o_proj.scales"] = t["model.layers.1.self_attn.o_proj.scales"][:-1].clone()
        return t

    with pytest.raises(CheckpointError, match=r"self_attn\.o_proj\.scales is torch.float16 \[3, 64\]"):
        LLM(str(_edit(qdir, tmp_path, "dense", short_dense)))
    # compressed-tensors: weight_shape that disagrees with the packed tensor
    ct, _ = written("ct-w4a16-g16")

    def wrong_shape(t):
        t[f"{EXPERT0}.down_proj.weight_shape"] = torch.tensor([64, 40], dtype=torch.int64)
        return t

    with pytest.raises(CheckpointError, match=rf"{EXPERT0}\.down_proj\.weight_shape is \[64, 40\]"):
        LLM(str(_edit(ct, tmp_path, "wshape", wrong_shape)))


def test_exclusions_must_match_the_tensors(written, tmp_path):
    qdir, _ = written("gptq4-g16-asym")
    # the config says a module is left unquantized, the checkpoint holds it quantized
    with pytest.raises(
        CheckpointError, match=r"self_attn\.k_proj\.qweight is quantized but .* leaves module"
    ):
        LLM(str(_edit(qdir, tmp_path, "excl", modules_to_not_convert=["model.layers.1.self_attn.k_proj"])))
    # routed experts under a per-module override: refused (one layout for every expert)
    with pytest.raises(
        ConfigError, match=r"routed expert module model\.layers\.0\.mlp\.experts\.0\.down_proj"
    ):
        LLM(str(_edit(qdir, tmp_path, "dyn", dynamic={r"+:.*experts.*down_proj": {"bits": 8}})))


def test_unsupported_settings_are_refused(written, tmp_path):
    qdir, _ = written("awq-g16")
    with pytest.raises(ConfigError, match="awq version 'gemv' is not supported"):
        LLM(str(_edit(qdir, tmp_path, "gemv", version="gemv")))
    ct, _ = written("ct-w4a16-g16")
    groups = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(ConfigError, match="actorder 'group'"):
        LLM(str(_edit(ct, tmp_path, "actorder", config_groups=groups)))
    gq, _ = written("gptq4-g16-asym")
    with pytest.raises(ConfigError, match="gptq bits=3 is not supported"):
        LLM(str(_edit(gq, tmp_path, "bits3", bits=3)))


def test_format_per_config_group(written, twin_results, tmp_path):
    """Newer compressed-tensors write `format: mixed-precision` and the format in each config group."""
    ct, _ = written("ct-w4a16-g16")
    groups = json.loads((ct / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["format"] = "pack-quantized"
    llm = LLM(str(_edit(ct, tmp_path, "mixed", format="mixed-precision", config_groups=groups)))
    twin_logits = twin_results("ct-w4a16-g16")[0]
    torch.testing.assert_close(
        llm.logits(SEQ), twin_logits, atol=2e-5 * twin_logits.abs().max().item(), rtol=0
    )
    groups["group_1"] = {
        "targets": ["re:.*o_proj$"],
        "format": "float-quantized",
        "weights": dict(num_bits=8, type="float", strategy="channel"),
    }
    with pytest.raises(ConfigError, match="compressed-tensors mixes the formats"):
        LLM(str(_edit(ct, tmp_path, "mixed2", format="mixed-precision", config_groups=groups)))
