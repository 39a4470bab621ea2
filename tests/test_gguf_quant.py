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
