"""GGUF files whose routed-expert types differ between layers, as llama-quantize writes Q4_K_M (the down
experts Q6_K in the layers `use_more_bits` picks, Q4_K in the others) and as UD files mix gate, up and
down per layer. Such a file loads as method gguf-layers: each layer's parts keyed by their type, the
slot pools grouped by layout. Logits in exact math equal transformers' on the weights the `gguf` package
dequantizes from the file; tiered equals resident; every slot holds exactly its expert's file bytes."""

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

import checkpoints as C
from gguf_files import (
    dequantized_tensors,
    gguf_names,
    qwen3moe_metadata,
    random_blocks,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, kernels
from expertcache.experts.layout import LayerParts
from expertcache.quant.ggml import tier_type
from expertcache.quant.ggml_blocks import BY_NAME, q3_k_as_q6_k
from expertcache.units import fmt_bytes

PROMPT = [1, 5, 9, 33, 100, 7, 250, 3]
LAYERS, E, H, I = 4, 8, 256, 256  # K-quant rows need 256-element multiples


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's rule for which layers' ffn_down get Q6_K under Q4_K_M (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


Q4_K_M = {
    layer: {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K" if use_more_bits(layer, LAYERS) else "Q4_K"}
    for layer in range(LAYERS)
}
UD = {  # gate and up differing too, and a layer in Q8_0 / IQ4_XS / Q5_K
    0: {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"},
    1: {"gate": "IQ4_XS", "up": "IQ4_XS", "down": "Q8_0"},
    2: {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"},
    3: {"gate": "Q8_0", "up": "Q6_K", "down": "Q5_K"},
}
GATE_UP = {  # blk.N.ffn_gate_up_exps (gate and up in one stack), its type differing between layers
    layer: {"gate_up": ("Q4_K", "Q6_K")[layer % 2], "down": ("Q6_K", "Q4_K")[layer % 2]}
    for layer in range(LAYERS)
}
MIXES = {"q4_k_m": Q4_K_M, "ud": UD, "gate_up": GATE_UP}
CONVERTED = {  # types no kernel reads (converted at load: Q3_K -> Q6_K exactly, the rest -> f32)
    0: {"gate": "Q2_K", "up": "Q3_K", "down": "IQ2_XXS"},
    1: {"gate": "Q4_1", "up": "Q5_1", "down": "IQ3_S"},
    2: {"gate": "Q4_K", "up": "Q4_K", "down": "Q3_K"},
    3: {"gate": "IQ2_XS", "up": "IQ3_XXS", "down": "Q6_K"},
}
ALL = {**MIXES, "converted": CONVERTED}


@pytest.fixture(scope="module")
def k_checkpoint(checkpoint):
    return checkpoint("qwen3_moe", hidden_size=H, moe_intermediate_size=I, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def mixed_gguf(k_checkpoint, tmp_path_factory):
    """mix name -> a .gguf of the checkpoint's dense weights (F32) with random valid expert blocks in the
    mix's types per layer and projection."""
    root = tmp_path_factory.mktemp("gguf-layers")
    cfg = json.loads((k_checkpoint / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(
        k_checkpoint / "tokenizer.json", "qwen2", cfg["vocab_size"], eos="<|im_end|>"
    )
    arrays = {k: v for k, v in gguf_names(C.read_tensors(k_checkpoint)).items() if "_exps" not in k}
    files = {}

    def get(mix: str):
        if mix not in files:
            raw = {}
            for layer, types in ALL[mix].items():
                for n, (proj, t) in enumerate(types.items()):
                    rows, cols = {"down": (H, I), "gate_up": (2 * I, H)}.get(proj, (I, H))
                    blocks = random_blocks(t, E * rows, cols, seed=10 * layer + n)
                    raw[f"blk.{layer}.ffn_{proj}_exps.weight"] = (t, blocks.reshape(E, rows, -1))
            files[mix] = write_gguf(root / f"{mix}.gguf", "qwen3moe", arrays, meta, raw=raw)
        return files[mix]

    return get


def _rel(got, expected) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("mix", sorted(ALL))
def test_logits_equal_transformers_on_the_dequantized_weights(k_checkpoint, mixed_gguf, mix):
    path = mixed_gguf(mix)
    expected = C.reference_logits(
        reference_with(C.load_reference(k_checkpoint), dequantized_tensors(path)), PROMPT
    )
    llm = LLM(str(path))
    try:
        src = llm.source
        assert src.method.name == "gguf-layers" and isinstance(src.parts, LayerParts)
        for layer, types in ALL[mix].items():
            assert [p.name for p in src.layer_parts(layer, stored=True)] == [
                f"{q}.{t.lower()}" for q, t in types.items()
            ]
            assert [p.name for p in src.layer_parts(layer)] == [
                f"{q}.{tier_type(t).lower()}" for q, t in types.items()
            ]
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    assert torch.isfinite(expected).all()
    assert _rel(got, expected) < 1e-3


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_tiered_equals_resident_and_each_slot_holds_its_file_bytes(mixed_gguf, mix):
    path = mixed_gguf(mix)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    resident = LLM(str(path))
    tiered = LLM(str(path), device_memory="25%", prefetch=False)  # 2 of 8 slots per layer: disk reads
    # disk -> 4 host slots -> 2 device slots per layer, each tier grouped by layout
    three = LLM(str(path), device_memory="25%", host_memory="50%", prefetch=False)
    try:
        expected = resident.logits(PROMPT)
        assert _rel(tiered.logits(PROMPT), expected) < 1e-5  # the same kernels; pairs summed in another order
        assert _rel(three.logits(PROMPT), expected) < 1e-5
        assert three.experts.host_slots == 4 and three.experts.host.where is not None
        three.experts.check(contents=True)  # host and device slots equal the checkpoint's bytes
        cache = tiered.experts
        cache.check(contents=True)  # every filled slot equals the checkpoint's bytes
        seen = set()
        for i, layer in enumerate(cache.layers):
            table = cache.dev_tables[i]
            assert table.resident(), f"layer {layer}: no expert in a device slot after a step"
            e = table.resident()[0]
            views = cache.dev.views(i, table.slot_of[e])
            for proj, t in MIXES[mix][layer].items():
                stack = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
                per = stack.n_bytes // E
                ((_f, off, n),) = tiered.source.ranges(layer, e)[f"{proj}.{t.lower()}"]
                assert (off, n) == (stack.data_offset + e * per, per)
                slot = views[f"{proj}.{t.lower()}"]
                assert slot.numel() == per  # exactly its bytes: no padding to another layer's type
                assert bytes(slot.contiguous().numpy()) == stack.data[e].tobytes()
                seen.add(t)
        assert seen == {t for types in MIXES[mix].values() for t in types.values()}
        # every tier sized from (type, dims) per layer: the slots' bytes are the sum of each layer's
        per_layer = [
            sum(tensors[f"blk.{la}.ffn_{p}_exps.weight"].n_bytes // E for p in MIXES[mix][la])
            for la in range(LAYERS)
        ]
        assert cache.dev.nbytes == cache.device_slots * sum(per_layer)
        assert tiered.source.total_nbytes == E * sum(per_layer)
        assert tiered.source.expert_nbytes == -(-sum(per_layer) // LAYERS)
    finally:
        resident.close()
        tiered.close()
        three.close()


def test_plan_sizes_the_layers_from_their_types(mixed_gguf, capsys):
    from expertcache.cli import main

    path = mixed_gguf("q4_k_m")
    main(["plan", str(path)])
    out = capsys.readouterr().out
    # gate/up Q4_K [256, 256] = 256 rows x 144 B; down Q4_K 256 x 144 or Q6_K 256 x 210
    q4, q6 = 3 * 256 * 144, 2 * 256 * 144 + 256 * 210
    n6 = sum(use_more_bits(i, LAYERS) for i in range(LAYERS))
    assert n6 == 2
    mean = -(-(n6 * q6 + (LAYERS - n6) * q4) // LAYERS)
    assert mean == 119040  # the mean over the layers: layers x slots x it = the slots' bytes exactly here
    assert f"one expert: {fmt_bytes(mean)} stored (gguf-layers)" in out
    assert (
        f"{LAYERS} layers x {E} experts x {fmt_bytes(mean)} = {fmt_bytes(E * LAYERS * mean)} on disk" in out
    )


def test_types_without_a_kernel_are_converted_at_load_exactly(mixed_gguf, capfd):
    """Q3_K slots hold Q6_K blocks of the same values, the other types float32 of their values (the gguf
    package's dequantiser the oracle); one line per type says which format; tiered equals resident."""
    path = mixed_gguf("converted")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    capfd.readouterr()
    resident = LLM(str(path))
    err = capfd.readouterr().err
    tiered = LLM(str(path), device_memory="25%", host_memory="50%", prefetch=False)
    try:
        for t, how in (
            ("Q2_K", "dequantized to F32 (exact)"),
            ("Q3_K", "repacked to Q6_K (the same values)"),
            ("IQ2_XXS", "dequantized to F32"),
            ("Q4_1", "dequantized to F32"),
            ("IQ3_S", "dequantized to F32"),
        ):
            lines = [ln for ln in err.splitlines() if f"routed experts in {t} " in ln]
            assert len(lines) == 1 and how in lines[0], err
        assert "in Q4_K " not in err and "in Q6_K " not in err  # read as stored: no line
        assert _rel(tiered.logits(PROMPT), resident.logits(PROMPT)) < 1e-5
        tiered.experts.check(contents=True)  # every filled slot equals the converted checkpoint bytes

        # the tiers sized from each layer's (type, dims): float32 4 B a weight, Q6_K 210 B a 256 block
        def tier_bytes(t: str, n: int = H * I) -> int:  # a weight's bytes in its tier type
            target = tier_type(t)
            return 4 * n if target == "F32" else n // BY_NAME[target].block * BY_NAME[target].block_bytes

        assert tier_bytes("Q3_K") == 256 * 210 and tier_bytes("IQ2_XXS") == 4 * H * I
        per_layer = [sum(tier_bytes(t) for t in types.values()) for types in CONVERTED.values()]
        assert tiered.experts.dev.nbytes == tiered.experts.device_slots * sum(per_layer)
        assert tiered.experts.host.nbytes == tiered.experts.host_slots * sum(per_layer)
        assert tiered.source.expert_nbytes == -(-sum(per_layer) // LAYERS)
        assert tiered.source.total_nbytes == sum(t.n_bytes for n, t in tensors.items() if "_exps" in n)
        pools = resident.experts.pools
        for layer, types in CONVERTED.items():
            for proj, t in types.items():
                stack = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
                want = torch.from_numpy(
                    gguf.quants.dequantize(stack.data[3], stack.tensor_type).astype("float32")
                )
                target = tier_type(t).lower()
                slot = pools[layer][f"{proj}.{target}"][3]
                if target == "f32":
                    assert torch.equal(slot, want)
                else:
                    raw = torch.from_numpy(stack.data[3].copy()).reshape(-1, stack.data.shape[-1])
                    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[stack.tensor_type][1])
                    if target != t.lower():  # Q3_K: Q6_K blocks of the same values
                        blocks = q3_k_as_q6_k(blocks)
                    assert torch.equal(slot.reshape(blocks.shape), blocks)
                    q6 = gguf.quants.dequantize(slot.numpy(), gguf.GGMLQuantizationType[target.upper()])
                    assert torch.equal(torch.from_numpy(q6.astype("float32")), want)
    finally:
        resident.close()
        tiered.close()


@pytest.mark.skipif(
    not (kernels.backend() == "cpp" and kernels.extension().fast_supported()),
    reason="the fast CPU math needs the C++ kernels and AVX-512 BF16/VNNI",
)
def test_fast_math_reads_a_layers_keyed_parts_as_the_per_projection_method_does():
    """The same bytes keyed by type (gguf-layers) and as gguf-mixed's P.weight: under fast math the MoE
    kernel and the prefill path (weights to the bf16 matmul) give bit-identical outputs."""
    from expertcache.experts.ffn import SWIGLU
    from expertcache.experts.prefill import prefill_moe
    from expertcache.kernels import prefill_gemm
    from expertcache.quant.ggml import mixed_method
    from expertcache.quant.method import make_quant_method

    S, T = 4, 64
    g, u = (torch.from_numpy(random_blocks("Q4_K", S * I, H, seed=s)).view(S, I, -1) for s in (1, 2))
    d = torch.from_numpy(random_blocks("Q6_K", S * H, I, seed=3)).view(S, H, -1)
    keyed = ({"gate.q4_k": g, "up.q4_k": u, "down.q6_k": d}, make_quant_method("gguf-layers"))
    plain = (
        {"gate.weight": g, "up.weight": u, "down.weight": d},
        make_quant_method(mixed_method({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})),
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    slots, w = torch.randint(0, S, (T, 2), generator=gen), torch.rand(T, 2, generator=gen)
    with kernels.cpu_math("fast"):
        outs = []
        for pool, method in (keyed, plain):
            out = torch.zeros(T, H)
            assert kernels.moe(x, slots, w, pool, method, out, SWIGLU)
            with prefill_gemm.fixed_crossover(prefill_gemm.MIN_T):
                done = prefill_moe(x, slots, w, pool, method, SWIGLU, None)
            assert done is not None  # every expert has >= MIN_T tokens here: the bf16 matmul took them
            outs.append((out, done[0]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_decoding_through_three_tiers_equals_resident(mixed_gguf):
    """Steps of decode with prefetch and the exclusive RAM tiers' demotions: each miss read, demoted and
    promoted in its own layer's layout; greedy tokens and every slot's bytes as resident's."""
    from expertcache import SamplingParams

    path = mixed_gguf("ud")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = []
    for kwargs in ({}, dict(device_memory="25%", host_memory="38%")):
        llm = LLM(str(path), **kwargs)
        try:
            outs.append(llm.generate([PROMPT], params)[0].token_ids)
            if kwargs:
                cache = llm.experts
                assert cache.exclusive and cache.host.where is not None
                assert cache.counters[0].misses > 0  # experts moved
                cache.check(contents=True)
        finally:
            llm.close()
    assert outs[0] == outs[1]


def test_experts_in_a_type_no_decoder_reads_are_refused_naming_the_tensor(k_checkpoint, tmp_path):
    from expertcache.errors import CheckpointError

    cfg = json.loads((k_checkpoint / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(
        k_checkpoint / "tokenizer.json", "qwen2", cfg["vocab_size"]
    )
    arrays = {k: v for k, v in gguf_names(C.read_tensors(k_checkpoint)).items() if "_exps" not in k}
    raw = {}
    for layer in range(LAYERS):
        for proj in ("gate", "up", "down"):
            t = "Q8_K" if (layer, proj) == (2, "down") else "Q4_K"
            raw[f"blk.{layer}.ffn_{proj}_exps.weight"] = (
                t,
                random_blocks(t, E * 256, 256).reshape(E, 256, -1),
            )
    path = write_gguf(tmp_path / "q8k.gguf", "qwen3moe", arrays, meta, raw=raw)
    with pytest.raises(
        CheckpointError, match=r"tensor blk\.2\.ffn_down_exps\.weight \(routed experts\) is Q8_K"
    ):
        LLM(str(path))


def test_expert_parallel_ranks_hold_per_layer_types_and_equal_one_process(mixed_gguf):
    """Expert parallelism over the Q4_K_M mix: each rank reads its experts' blocks (types differing by layer)
    from the file; logits equal the one-process engine's."""
    path = mixed_gguf("q4_k_m")
    one = LLM(str(path))
    try:
        want = one.logits(PROMPT)
    finally:
        one.close()
    ep = LLM(str(path), expert_parallel=2)
    try:
        got = ep.logits(PROMPT)
        assert sum(ep.expert_stats()["expert_parallel"]["pairs_per_rank_last_step"]) > 0
    finally:
        ep.close()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
