"""Quant methods: stored layout, byte counts, dequantize/linear and errors."""

from __future__ import annotations

import pytest
import torch

from expertcache.quant.method import QUANT_METHODS, QuantMethod, make_quant_method

PROJS = ("gate_proj", "up_proj", "down_proj")


def expert(shape=(256, 256), seed=0, projs=PROJS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{p}.weight": torch.randn(shape, generator=g) * 0.02 for p in projs}


def stored_bytes(stored: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in stored.values())


# Bytes of one [256 x 256] gate/up/down expert, computed by hand:
#   bf16 3*256*256*2; fp8 3*(65536 + 2*2*4); fp8-channel 3*(65536 + 256*4);
#   fp8-tensor 3*(65536 + 4); int8 3*(65536 + 256*2*4); int4 3*(32768 + 256*2*(4+1));
#   mxfp4 3*(256*8*16 + 256*8)
EXPECTED_256 = {
    "fp32": 786432,
    "bf16": 393216,
    "fp16": 393216,
    "fp8": 196656,
    "fp8-channel": 199680,
    "fp8-tensor": 196620,
    "int8": 202752,
    "int4": 105984,
    "mxfp4": 104448,
}
# max abs round-trip error allowed for N(0, 0.02) weights (loose sanity, exact bounds are in test_quant_formats)
TOL = {
    "fp32": 0,
    "bf16": 4e-4,
    "fp16": 1e-4,
    "fp8": 6e-3,
    "fp8-channel": 6e-3,
    "fp8-tensor": 6e-3,
    "int8": 5e-4,
    "int4": 8e-3,
    "mxfp4": 3e-2,
}


def test_registry_names():
    assert set(EXPECTED_256) == {
        n for n in QUANT_METHODS if not n.startswith("gguf-")
    }  # GGUF's: test_gguf_quant


@pytest.mark.parametrize("name", sorted(EXPECTED_256))
def test_nbytes_layout_and_roundtrip(name):
    m = make_quant_method(name)
    w = expert()
    stored = m.pack(w)
    assert 3 * m.nbytes((256, 256)) == stored_bytes(stored) == EXPECTED_256[name]
    layout = {}
    for p in PROJS:
        layout.update(m.layout(p, (256, 256)))
    assert {k: (tuple(t.shape), t.dtype) for k, t in stored.items()} == {
        k: tuple(v) for k, v in layout.items()
    }
    for p in PROJS:
        back = m.dequantize(stored, p)
        assert back.dtype == torch.float32 and back.shape == (256, 256)
        assert (back - w[f"{p}.weight"]).abs().max() <= TOL[name]


@pytest.mark.parametrize(
    "name,params,shape",
    [
        ("fp8", {"block_size": [128, 64]}, (300, 200)),
        ("int8", {"group_size": 128}, (40, 300)),
        ("int4", {"group_size": 128}, (40, 300)),
        ("mxfp4", {}, (40, 96)),
        ("fp8-channel", {}, (33, 70)),
        ("bf16", {}, (7, 9)),
    ],
)
def test_ragged_shapes_nbytes_buffer_and_linear(name, params, shape):
    m = make_quant_method(name, **params)
    w = expert(shape, seed=1, projs=("w1",))
    stored = m.pack(w)
    assert m.nbytes(shape) == stored_bytes(stored)
    fresh = m.dequantize(stored, "w1")
    buf = torch.full(shape, float("nan"))
    assert m.dequantize(stored, "w1.weight", out=buf) is buf
    assert torch.equal(buf, fresh)
    x = torch.randn(5, shape[1])
    y = m.linear(x, stored, "w1", buf=buf)
    torch.testing.assert_close(y, x @ fresh.t())
    # and against the original weight in float64: |x (w - w_q)^T| <= sum|x| * max|w - w_q| <= sum|x| * TOL
    exact = x.double() @ w["w1.weight"].double().T
    bound = x.double().abs().sum(1, keepdim=True) * TOL[name] + 1e-5
    assert bool(((y.double() - exact).abs() <= bound).all())


def test_bias_passes_through_and_bad_keys():
    m = make_quant_method("int8")
    b = torch.randn(256)
    stored = m.pack({"gate_proj.weight": torch.randn(256, 256), "gate_proj.bias": b})
    assert stored["gate_proj.bias"] is b
    with pytest.raises(ValueError, match="gate_proj'"):
        m.pack({"gate_proj": torch.randn(4, 4)})
    with pytest.raises(ValueError, match="up_proj.weight.*NaN"):
        m.pack({"up_proj.weight": torch.tensor([[1.0, float("nan")]])})
    with pytest.raises(ValueError, match="2-D"):
        m.pack({"up_proj.weight": torch.randn(4)})


def test_unknown_format_and_params():
    with pytest.raises(ValueError, match="unknown quant format 'nf4'.*mxfp4"):
        make_quant_method("nf4")
    with pytest.raises(ValueError, match="block_size"):
        make_quant_method("mxfp4", block_size=16)
    with pytest.raises(ValueError, match="group_size"):
        make_quant_method("int4", group_size=0)
    with pytest.raises(ValueError, match="block size"):
        make_quant_method("fp8", block_size=[128, 128, 1])


def test_missing_scale_names_tensor():
    m = make_quant_method("int4")
    stored = m.pack(expert((16, 256)))
    del stored["up_proj.weight_zero"]
    with pytest.raises(ValueError, match=r"missing up_proj\.weight_zero.*'int4'"):
        m.dequantize(stored, "up_proj")
    with pytest.raises(ValueError, match=r"missing w2\.weight "):
        m.dequantize(stored, "w2")
    mx = make_quant_method("mxfp4")
    s2 = mx.pack(expert((16, 64)))
    del s2["gate_proj.weight_scales"]
    with pytest.raises(ValueError, match=r"gate_proj\.weight_scales"):
        mx.dequantize(s2, "gate_proj")


def test_block_size_mismatch_is_reported():
    stored = make_quant_method("fp8", block_size=128).pack(expert((300, 200)))
    with pytest.raises(
        ValueError, match=r"gate_proj\.weight_scale .*\[3, 2\].*\[5, 4\].*block size \[64, 64\]"
    ):
        make_quant_method("fp8", block_size=64).dequantize(stored, "gate_proj")
    stored8 = make_quant_method("int8", group_size=128).pack(expert((8, 256)))
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale.*group size 64"):
        make_quant_method("int8", group_size=64).dequantize(stored8, "down_proj")


def test_scale_shape_and_dtype_errors():
    m = make_quant_method("fp8-channel")
    stored = m.pack(expert((16, 32)))
    stored["gate_proj.weight_scale"] = stored["gate_proj.weight_scale"][:8]
    with pytest.raises(ValueError, match=r"gate_proj\.weight_scale.*\[8, 1\].*\[16, 1\]"):
        m.dequantize(stored, "gate_proj")
    mi = make_quant_method("int8")
    s8 = mi.pack(expert((16, 32)))
    s8["up_proj.weight"] = s8["up_proj.weight"].to(torch.int16)
    with pytest.raises(ValueError, match=r"up_proj\.weight is torch\.int16"):
        mi.dequantize(s8, "up_proj")
    mx = make_quant_method("mxfp4")
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.pack({"w1.weight": torch.randn(4, 40)})
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.nbytes((4, 40))
    with pytest.raises(ValueError, match="even"):
        make_quant_method("int4").nbytes((4, 41))
    with pytest.raises(ValueError, match="3-D"):
        mx.dequantize({"w1.weight_blocks": torch.zeros(4, 16, dtype=torch.uint8)}, "w1")


def test_checkpoint_scale_names_and_dtypes_accepted():
    # DeepSeek names the block scale weight_scale_inv; compressed-tensors may ship [] or bf16 scales.
    m = make_quant_method("fp8", block_size=[128, 128])
    stored = m.pack(expert((200, 300), projs=("w3",)))
    want = m.dequantize(stored, "w3")
    ds = {
        "w3.weight": stored["w3.weight"].view(torch.uint8),
        "w3.weight_scale_inv": stored["w3.weight_scale"],
    }
    assert torch.equal(m.dequantize(ds, "w3"), want)
    t = make_quant_method("fp8-tensor")
    st = t.pack(expert((8, 16), projs=("w1",)))
    st["w1.weight_scale"] = st["w1.weight_scale"].reshape(()).to(torch.bfloat16)
    ref = st["w1.weight"].float() * st["w1.weight_scale"].float()
    assert torch.equal(t.dequantize(st, "w1"), ref)


def test_buffer_and_input_errors():
    m = make_quant_method("bf16")
    stored = m.pack(expert((8, 16)))
    with pytest.raises(ValueError, match=r"out buffer for gate_proj.*\[8, 16\]"):
        m.dequantize(stored, "gate_proj", out=torch.empty(16, 8))
    with pytest.raises(ValueError, match="non-contiguous"):
        m.dequantize(stored, "gate_proj", out=torch.empty(16, 8).t())
    with pytest.raises(ValueError, match="input has 7 features, weight expects 16"):
        m.linear(torch.randn(2, 7), stored, "gate_proj")


def test_every_method_is_a_quant_method():
    for name, cls in QUANT_METHODS.items():
        assert issubclass(cls, QuantMethod) and cls.name == name
