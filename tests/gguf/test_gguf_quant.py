"""GGUF block formats as QuantMethods (quant/ggml.py): the stored bytes decode to exactly what the
`gguf` package's dequantizer (the oracle) gives; pack writes the bytes its quantizers write."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import random_blocks

from expertcache.quant import QUANT_METHODS, make_quant_method
from expertcache.quant.ggml import mixed_method
from expertcache.quant.ggml_blocks import BY_NAME, METHODS, TYPES

Q = gguf.GGMLQuantizationType


def test_type_table_matches_the_gguf_package():
    for t in TYPES.values():
        if t.name in Q.__members__ and t.name != "Q8_1":  # (the package's Q8_1 is the old 40-byte block)
            assert gguf.GGML_QUANT_SIZES[Q[t.name]] == (t.block, t.block_bytes), t.name
            assert int(Q[t.name]) == t.id, t.name


@pytest.mark.parametrize("type_name", METHODS)
def test_dequantize_equals_the_gguf_package(type_name):
    m = make_quant_method(f"gguf-{type_name.lower()}")
    qk = BY_NAME[type_name].block
    out_f, in_f = 24, 2 * max(qk, 256)
    raw = random_blocks(type_name, out_f, in_f, seed=len(type_name))
    w = torch.from_numpy(raw)
    layout = m.layout("gate", (out_f, in_f))
    assert {k: (tuple(s.shape), s.dtype) for k, s in layout.items()} == {
        "gate.weight": (tuple(raw.shape), torch.uint8)
    }
    assert m.nbytes((out_f, in_f)) == raw.nbytes
    ref = gguf.quants.dequantize(raw, Q[type_name]).reshape(out_f, in_f)
    assert np.isfinite(ref).all()
    got = m.dequantize({"gate.weight": w}, "gate")
    np.testing.assert_array_equal(got.numpy(), ref)
    x = torch.randn(3, in_f)
    torch.testing.assert_close(m.linear(x, {"gate.weight": w}, "gate"), x @ torch.from_numpy(ref).T)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_pack_writes_the_gguf_quantizers_bytes(type_name):
    m = make_quant_method(f"gguf-{type_name.lower()}")
    w = torch.randn(16, 128) * 0.3
    w[0, :32] = 0  # an all-zero block
    w[1, 5] = 4.0  # a large value dominating its block
    stored = m.pack({"up.weight": w})
    ref = gguf.quants.quantize(w.numpy(), Q[type_name])
    np.testing.assert_array_equal(stored["up.weight"].numpy(), ref)


def test_shapes_are_checked():
    m = make_quant_method("gguf-q4_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        m.layout("gate", (8, 100))
    with pytest.raises(ValueError, match="whole 144-byte blocks"):
        m.dequantize({"gate.weight": torch.zeros(8, 100, dtype=torch.uint8)}, "gate")
    with pytest.raises(ValueError, match="no quantiser"):
        m.pack({"gate.weight": torch.zeros(8, 256)})


def test_mixed_method_gives_each_projection_its_own_type():
    name = mixed_method({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    assert name == "gguf-mixed:q4_k,q4_k,q6_k" and name in QUANT_METHODS
    assert mixed_method({"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}) == "gguf-q8_0"
    m = make_quant_method(name)
    assert m.layout("gate", (4, 256))["gate.weight"].shape == (4, 144)
    assert m.layout("down", (4, 256))["down.weight"].shape == (4, 210)
    raw = random_blocks("Q6_K", 4, 256)
    ref = gguf.quants.dequantize(raw, Q.Q6_K).reshape(4, 256)
    np.testing.assert_array_equal(m.dequantize({"down.weight": torch.from_numpy(raw)}, "down").numpy(), ref)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1", "Q2_K", "Q3_K"])
def test_dense_only_decoders_equal_the_gguf_package(type_name):
    from expertcache.quant.ggml_blocks import DECODERS

    raw = random_blocks(type_name, 8, 512, seed=3)
    ref = gguf.quants.dequantize(raw, Q[type_name]).reshape(-1)
    got = DECODERS[type_name](torch.from_numpy(raw).view(-1, BY_NAME[type_name].block_bytes)).reshape(-1)
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(got.numpy(), ref)


def test_q3_k_repacks_into_q6_k_blocks_of_the_same_values():
    from expertcache.quant.ggml_blocks import q3_k_as_q6_k

    raw = random_blocks("Q3_K", 16, 512, seed=5)
    q6 = q3_k_as_q6_k(torch.from_numpy(raw).view(-1, 110)).reshape(16, -1).numpy()
    assert q6.shape == (16, 2 * 210)
    ref = gguf.quants.dequantize(raw, Q.Q3_K)
    np.testing.assert_array_equal(gguf.quants.dequantize(q6, Q.Q6_K), ref)


def test_layers_method_reads_each_projections_type_from_its_key():
    from expertcache.quant.ggml import GGMLLayers, tier_type

    m = make_quant_method("gguf-layers")
    layer = GGMLLayers.for_layer({"gate": "Q4_K", "up": "IQ4_XS", "down": "Q6_K"})
    assert layer.layout("up", (4, 256)) == {"up.iq4_xs": ((4, 136), torch.uint8)}
    raw = {
        p: random_blocks(t, 4, 256, seed=n) for n, (p, t) in enumerate((("gate", "Q4_K"), ("down", "Q6_K")))
    }
    stored = {"gate.q4_k": torch.from_numpy(raw["gate"]), "down.q6_k": torch.from_numpy(raw["down"])}
    for p, t in (("gate", Q.Q4_K), ("down", Q.Q6_K)):
        ref = gguf.quants.dequantize(raw[p], t).reshape(4, 256)
        np.testing.assert_array_equal(m.dequantize(stored, p).numpy(), ref)
    with pytest.raises(ValueError, match=r"no stored tensor up\.<type>"):
        m.dequantize(stored, "up")
    with pytest.raises(ValueError, match="depends on the layer's types"):
        m.layout("gate", (4, 256))
    # what the tiers hold: kernel types as stored, Q3_K as Q6_K, other types dequantized to float32
    assert [tier_type(t) for t in ("Q4_K", "Q8_0", "Q3_K", "Q2_K", "IQ2_XXS")] == [
        "Q4_K",
        "Q8_0",
        "Q6_K",
        "F32",
        "F32",
    ]
    assert GGMLLayers.tier_layout("down.q2_k", (4, 256)) == {"down.f32": ((4, 256), torch.float32)}
    q2 = random_blocks("Q2_K", 4, 256, seed=9)
    got = GGMLLayers.to_tier("down.q2_k", torch.from_numpy(q2), (4, 256))["down.f32"]
    np.testing.assert_array_equal(got.numpy(), gguf.quants.dequantize(q2, Q.Q2_K).reshape(4, 256))
