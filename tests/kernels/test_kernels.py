"""The C++ CPU kernels (expertcache.kernels) against float64 references, and the fallback.

- every format (bf16, fp16, fp32, fp8 block / channel / tensor, int8, int4, mxfp4), T in
  {1, 2, 7, 16, 64, 300}, shapes that are not multiples of the vector width (8), the group or the
  block, through both the GEMV path and the tiled path, against x @ dequantize(W)^T in float64;
- the grouped MoE form (one call per layer) with empty slots, pairs skipped (-1) and a slot
  repeated within a token, the clamped SwiGLU and biases, against a float64 per-pair loop;
- the whole model with the kernels equals the pure-torch path (fp32 logits, 1e-4 relative);
- the kernels' threads: 1, 2, 3 threads bit-identical, a forked child computes too; around a forward
  the kernels get torch's thread count and torch one thread;
- the fallback: with no extension the same entry points decline and the torch code computes,
  with a printed note saying why.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from kernel_refs import moe_reference

from expertcache import LLM, kernels
from expertcache.experts.compute import ExpertFFN, moe_ffn
from expertcache.kernels import build
from expertcache.kernels.formats import quant_spec
from expertcache.quant import make_quant_method
from expertcache.quantize.rewrite import quantize_checkpoint

# (format, parameters): group/block sizes chosen so that shapes leave ragged edges
FORMATS = [
    ("bf16", {}),
    ("fp16", {}),
    ("fp32", {}),
    ("fp8", {"block_size": [16, 24]}),
    ("fp8-channel", {}),
    ("fp8-tensor", {}),
    ("int8", {"group_size": 40}),
    ("int8", {"group_size": 20}),
    ("int4", {"group_size": 36}),
    ("mxfp4", {}),
]
TOKENS = [1, 2, 7, 16, 64, 300]
PATHS = {"gemv": 1 << 30, "tiled": 0}  # SMALL_T for every format code


def _shape(fmt: str) -> tuple[int, int]:
    return (37, 352) if fmt == "mxfp4" else (37, 330)  # N odd; K not a multiple of 8, 24, 36 or 40


def _packed(fmt: str, params: dict, n: int, k: int, slots: int = 1, seed: int = 0):
    """-> (method, pool parts {"p.<suffix>": [S, ...]}, float64 dequantized weights [S, n, k])."""
    g = torch.Generator().manual_seed(seed)
    m = make_quant_method(fmt, **params)
    parts, dense = [], []
    for _ in range(slots):
        p = m.pack({"p.weight": torch.randn(n, k, generator=g)})
        parts.append(p)
        dense.append(m.dequantize(p, "p").double())
    pool = {key: torch.stack([p[key] for p in parts]) for key in parts[0]}
    return m, pool, torch.stack(dense)


def _close(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, rtol: float = 2e-6) -> None:
    """|y - ref| <= rtol * bound elementwise, bound = |x| @ |W|^T (the float32 rounding scale)."""
    err = (y.double() - ref).abs()
    worst = (err / (bound + 1e-30)).max().item()
    assert worst <= rtol, f"max error {worst:.3g} of |x||W| (allowed {rtol})"


needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason=f"C++ kernels unavailable: {kernels.why()}")


def test_users_get_the_cpp_kernels():
    """Where a C++ compiler exists (CI, `make setup`), the engine runs the C++ kernels, not the fallback."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert kernels.backend() == "cpp", kernels.why()


@needs_cpp
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,params", FORMATS, ids=[f"{f}-{p}" for f, p in FORMATS])
def test_linear_every_format_against_float64(fmt, params, path):
    n, k = _shape(fmt)
    m, pool, w = _packed(fmt, params, n, k)
    spec = quant_spec(m, pool, "p", n, k)
    ext = kernels.extension()
    for T in TOKENS:
        x = torch.randn(T, k, generator=torch.Generator().manual_seed(T))
        y = ext.linear(x, spec, 0, PATHS[path], 8, 0)
        assert y.shape == (T, n) and y.dtype == torch.float32
        _close(y, x.double() @ w[0].T, x.double().abs() @ w[0].abs().T)


@needs_cpp
def test_dense_linear_bf16_weight_and_fallback_cases():
    w = torch.randn(70, 33).bfloat16()
    x = torch.randn(2, 5, 33)
    y = kernels.dense_linear(x, w)
    assert y.shape == (2, 5, 70)
    _close(
        y.reshape(10, 70),
        x.reshape(10, 33).double() @ w.double().T,
        x.reshape(10, 33).double().abs() @ w.double().abs().T,
    )
    assert kernels.dense_linear(x.double(), w) is None  # float64 activations: not a kernel case
    assert kernels.dense_linear(x, w.to(torch.float8_e4m3fn)) is None  # no plain kernel for raw fp8


def _moe_pool(fmt, params, S, H, I):
    mg, pg, gate = _packed(fmt, params, I, H, S, seed=1)
    _, pu, up = _packed(fmt, params, I, H, S, seed=2)
    _, pd, down = _packed(fmt, params, H, I, S, seed=3)
    rename = lambda pool, proj: {key.replace("p.", f"{proj}.", 1): t for key, t in pool.items()}  # noqa: E731
    pool = {**rename(pg, "gate"), **rename(pu, "up"), **rename(pd, "down")}
    if fmt in ("bf16", "fp16", "fp32"):  # plain pools are gate_up [S, 2I, H] + down [S, H, I]
        pool = {
            "gate_up": torch.cat([pool["gate.weight"], pool["up.weight"]], 1),
            "down": pool["down.weight"],
        }
        mg = None
    return mg, pool, gate, up, down


def _routing(T, K, S, seed=0):
    """slots with -1 (skipped pairs), one slot repeated within a token, slot S-1 never used (empty)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, S - 1, (T, K), generator=g)
    slots[0, :] = slots[0, 0]  # repeated slot
    slots[T // 2, 1] = -1
    weights = torch.rand(T, K, generator=g)
    return slots, weights


@needs_cpp
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,params", FORMATS, ids=[f"{f}-{p}" for f, p in FORMATS])
def test_grouped_moe_against_float64(fmt, params, path, monkeypatch):
    monkeypatch.setattr(kernels, "SMALL_T", dict.fromkeys(range(7), PATHS[path]))
    S, H, I, K = 5, 64 if fmt == "mxfp4" else 60, 96 if fmt == "mxfp4" else 44, 3
    method, pool, gate, up, down = _moe_pool(fmt, params, S, H, I)
    for T in (1, 7, 64):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        slots, weights = _routing(T, K, S, seed=T)
        out = torch.zeros(T, H)
        assert kernels.moe(x, slots, weights, pool, method, out)
        ref, _ = moe_reference(x, slots, weights, gate, up, down)
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _fused_pool(fmt, params, S, H, I, interleaved):
    """A fused gate_up pool (plain [S, 2I, H], or quantized parts "gate_up.*"), gate rows first or
    interleaved (gate = even rows); -> (method, pool, gate, up, down) with float64 dequantized weights."""
    method, pgu, gu = _packed(fmt, params, 2 * I, H, S, seed=4)
    _, pd, down = _packed(fmt, params, H, I, S, seed=5)
    gate, up = (gu[:, 0::2], gu[:, 1::2]) if interleaved else (gu[:, :I], gu[:, I:])
    pool = {
        **{k.replace("p.", "gate_up.", 1): t for k, t in pgu.items()},
        **{k.replace("p.", "down.", 1): t for k, t in pd.items()},
    }
    if fmt in ("bf16", "fp16", "fp32"):
        pool, method = {"gate_up": pool["gate_up.weight"], "down": pool["down.weight"]}, None
    return method, pool, gate, up, down


@needs_cpp
@pytest.mark.parametrize(
    "fmt,params,layout",
    [
        ("int8", {"group_size": 16}, "split"),
        ("bf16", {}, "interleaved"),
        ("mxfp4", {}, "fused-interleaved"),
        ("int4", {"group_size": 8}, "fused"),
    ],
)
def test_grouped_moe_clamped_swiglu_biases_layouts_and_accumulation(fmt, params, layout, monkeypatch):
    S, H, I, K, T = 4, 64, 32, 2, 9
    interleaved = "interleaved" in layout
    if layout == "split":
        method, pool, gate, up, down = _moe_pool(fmt, params, S, H, I)
    else:
        method, pool, gate, up, down = _fused_pool(fmt, params, S, H, I, interleaved)
    ffn = ExpertFFN(
        act="clamped_swiglu",
        interleaved=interleaved,
        fused_quant=method is not None and layout != "split",
        alpha=1.702,
        limit=7.0,
    )
    g = torch.Generator().manual_seed(5)
    bg, bu, bd = (
        torch.randn(S, I, generator=g),
        torch.randn(S, I, generator=g),
        torch.randn(S, H, generator=g),
    )
    gu_bias = torch.stack([bg, bu], -1).reshape(S, 2 * I) if interleaved else torch.cat([bg, bu], 1)
    pool = {**pool, "down_bias": bd}
    if layout != "split":  # (split gate/up parts carry no gate_up bias in any supported family)
        pool["gate_up_bias"] = gu_bias
    else:
        bg, bu = torch.zeros(S, I), torch.zeros(S, I)
    x = 3 * torch.randn(T, H, generator=g)  # large enough that the clamps at +-7 engage
    slots, weights = _routing(T, K, S)
    start = torch.randn(T, H, generator=g)
    out = start.clone()
    assert kernels.moe(x, slots, weights, pool, method, out, ffn)
    ref, _ = moe_reference(x, slots, weights, gate, up, down, act="clamped_swiglu", biases=(bg, bu, bd))
    ref = start.double() + ref
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    with monkeypatch.context() as mp:
        _no_extension(mp, "disabled by the test")
        torch_path = moe_ffn(x, slots, weights, pool, method, out=start.clone(), ffn=ffn)
    assert (torch_path.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # the torch code agrees


@needs_cpp
def test_grouped_moe_errors_name_the_problem():
    _, pool, *_ = _moe_pool("bf16", {}, 3, 16, 8)
    x, out = torch.randn(2, 16), torch.zeros(2, 16)
    with pytest.raises(RuntimeError, match="slot 3 out of range"):
        kernels.moe(x, torch.tensor([[0], [3]]), torch.ones(2, 1), pool, None, out)
    with pytest.raises(RuntimeError, match="x has 15 features"):
        kernels.moe(
            torch.randn(2, 15),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            pool,
            None,
            torch.zeros(2, 15),
        )


@needs_cpp
def test_threads_agree_and_a_forked_child_computes():
    """The kernels' thread pool: 1, 2 and 3 threads give bit-identical results (each unit of rows is
    computed the same way on whichever thread takes it), and a forked child (no pool threads of its
    own yet) computes the same as the parent."""
    import multiprocessing

    _, pool, w = _packed("bf16", {}, 1000, 96)
    spec = quant_spec(make_quant_method("bf16"), pool, "p", 1000, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    ext, before = kernels.extension(), torch.get_num_threads()
    try:
        ys = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            ys.append(ext.linear(x, spec, 0, 1 << 30, 8, 0))
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as child:
            forked = child.apply_async(_linear_in_child, (x, spec)).get(timeout=60)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    assert torch.equal(forked, ys[0])
    _close(ys[0], x.double() @ w[0].T, x.double().abs() @ w[0].abs().T)


@needs_cpp
def test_cpu_threads_kernels_get_the_count_torch_one_thread_restored():
    """Around a CPU forward the kernels take torch's thread count and torch's ops one thread; both are
    restored afterwards (also after an error); on other devices nothing changes."""
    ext, before = kernels.extension(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with kernels.cpu_threads("cpu"):
            assert (torch.get_num_threads(), ext.get_threads()) == (1, 2)
        assert (torch.get_num_threads(), ext.get_threads()) == (2, 0)
        with pytest.raises(KeyError):
            with kernels.cpu_threads("cpu"):
                raise KeyError("x")
        assert (torch.get_num_threads(), ext.get_threads()) == (2, 0)
        with kernels.cpu_threads("meta"):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@needs_cpp
@pytest.mark.parametrize(
    "fmt,params", [f for f in FORMATS if f[0] in ("bf16", "int8", "fp8", "mxfp4")], ids=lambda f: str(f)
)
def test_specs_built_once_follow_slot_refills(fmt, params):
    """Weight specs are cached per pool (the same tensor objects every step): a slot refilled in place
    computes with its new bytes, and a pool dict rebuilt from other tensors is not mistaken for it."""
    method, pool, gate, up, down = _moe_pool(fmt, params, 4, 64, 32)
    x = torch.randn(5, 64)
    slots, weights = _routing(5, 2, 4)

    def check(gate, up, down):
        out = torch.zeros(5, 64)
        assert kernels.moe(x, slots, weights, pool, method, out)
        ref, _ = moe_reference(x, slots, weights, gate, up, down)
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()

    check(gate, up, down)
    _, other, gate2, up2, down2 = _moe_pool(fmt, {**params}, 4, 64, 32)
    other = {n: t.flip(0).contiguous() for n, t in other.items()}  # slot s holds expert 3 - s
    for n, t in pool.items():
        t.copy_(other[n])  # a refill of every slot, in place
    check(gate2.flip(0), up2.flip(0), down2.flip(0))
    pool = dict(other)  # new tensors: a new entry, never the old pool's specs
    check(gate2.flip(0), up2.flip(0), down2.flip(0))
    w = torch.randn(7, 64).bfloat16()
    y = kernels.dense_linear(x, w)
    w.copy_(torch.randn(7, 64))  # dense weights are views too
    assert torch.allclose(kernels.dense_linear(x, w), x @ w.float().T, atol=1e-5) and not torch.allclose(
        y, x @ w.float().T
    )


@needs_cpp
@pytest.mark.parametrize("act", ["silu", "clamped_swiglu"])
def test_activation_over_the_whole_float_range(act):
    """The vectorised activation (its own e^x) against float64 for gate values from -120 to 120,
    past where e^-g overflows float32, and a width that leaves a scalar tail (I = 44)."""
    H, I = 48, 44
    c = torch.linspace(-120, 120, I).bfloat16()
    gate = torch.zeros(1, I, H, dtype=torch.bfloat16)
    gate[0, :, 0] = c  # g_j = c_j for x = e_0
    up = torch.zeros(1, I, H, dtype=torch.bfloat16)
    up[0, :, 0] = torch.linspace(-9, 9, I).bfloat16()  # u_j spans the clamp limit too
    down = torch.eye(H, I, dtype=torch.bfloat16)[None]  # out_j = h_j: every activation value seen alone
    pool = {"gate_up": torch.cat([gate, up], 1), "down": down}
    x = torch.zeros(1, H)
    x[0, 0] = 1.0
    ffn = ExpertFFN(act=act, alpha=1.702, limit=7.0) if act != "silu" else None
    out = torch.zeros(1, H)
    assert kernels.moe(x, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), pool, None, out, ffn)
    ref = moe_reference(
        x,
        torch.zeros(1, 1, dtype=torch.long),
        torch.ones(1, 1),
        gate.double(),
        up.double(),
        down.double(),
        act=act,
    )[0][0, :I]
    assert ref.abs().max() > 50 and (ref.abs() < 1e-30).any()  # the range reaches both ends
    # float32 rounds the exponent's argument a*g (relative 2^-24), which e^(a*g) turns into an absolute
    # error of |a*g| * 2^-24 in its own relative terms: the same in torch's float32 path
    arg = c.double().clamp(max=7.0) * 1.702 if act != "silu" else c.double()
    assert ((out[0, :I].double() - ref).abs() <= (1e-6 + arg.abs() * 2.0**-23) * ref.abs() + 1e-30).all()


@needs_cpp
@pytest.mark.parametrize("act", ["silu", "clamped_swiglu"])
def test_activation_keeps_nan(act):
    """A NaN gate or up value stays NaN through the vectorised activation (a clamp must not turn it into
    the limit), so a non-finite expert shows up in the layer's output and the engine can name it."""
    H, I = 16, 16
    gate_up = torch.zeros(1, 2 * I, H, dtype=torch.bfloat16)
    gate_up[0, 3, 0] = float("nan")  # gate row 3 (a clamp to the limit would make h_3 finite)
    gate_up[0, I:, 0] = 1.0
    pool = {"gate_up": gate_up, "down": torch.eye(H, I, dtype=torch.bfloat16)[None]}
    x = torch.zeros(1, H)
    x[0, 0] = 1.0
    out = torch.zeros(1, H)
    ffn = ExpertFFN(act=act, alpha=1.702, limit=7.0) if act != "silu" else None
    assert kernels.moe(x, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), pool, None, out, ffn)
    assert out[0].isnan().all()  # h_3 is NaN, and every output row of down reads it (0 * NaN = NaN)


def _linear_in_child(x, spec):
    torch.set_num_threads(2)
    return kernels.extension().linear(x, spec, 0, 1 << 30, 8, 0)


def _no_extension(monkeypatch, why="no C++ compiler found (install g++ and run `make setup`)"):
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_compile", lambda: (None, why))


def test_fallback_prints_a_note_and_torch_computes(monkeypatch, capsys):
    _no_extension(monkeypatch)
    assert kernels.backend() == "torch"
    assert "pure-torch expert kernels: no C++ compiler found" in capsys.readouterr().err
    method, pool, gate, up, down = _moe_pool("int4", {"group_size": 16}, 4, 32, 16)
    x = torch.randn(6, 32)
    slots, weights = _routing(6, 2, 4)
    assert not kernels.moe(x, slots, weights, pool, method, torch.zeros(6, 32))
    out = moe_ffn(x, slots, weights, pool, method)  # the torch path of experts.compute
    ref, _ = moe_reference(x, slots, weights, gate, up, down)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert kernels.dense_linear(x, torch.randn(3, 32).bfloat16()) is None
    assert not kernels.reads_stored("cpu", torch.float32)


@needs_cpp
def test_a_finished_build_loads_without_ninja_or_its_lock(monkeypatch, tmp_path):
    """A finished build is imported directly: a build lock left by a killed process (or another checkout
    with the same sources building at once) must not make a load wait, and nothing is rebuilt."""
    built = build.cache_dir()
    shutil.copy(built / "expertcache_kernels.so", tmp_path / "expertcache_kernels.so")
    (tmp_path / "lock").touch()  # fresh: not old enough to be dropped as stale
    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path)

    def no_build(out):
        raise AssertionError("rebuilt a finished build")

    monkeypatch.setattr(build, "_build", no_build)
    (tmp_path / build.BUILT).touch()
    mod, why = build._compile()
    assert why == "" and mod.cpu_supported()
    x, w = torch.randn(3, 40), torch.randn(5, 40).bfloat16()
    y = mod.linear(x, kernels.formats.plain_spec(w.unsqueeze(0)), 0, 1 << 30, 8, 0)
    assert torch.allclose(y, x @ w.float().T, atol=1e-5)
    (tmp_path / build.BUILT).unlink()  # no marker: an unfinished directory is built, not trusted
    mod, why = build._compile()
    assert mod is None and "rebuilt a finished build" in why


SEQ = [(i * 37 + 11) % 300 + 3 for i in range(40)]
MODEL = dict(
    dtype=torch.bfloat16,
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    num_hidden_layers=2,
    num_experts_per_tok=2,
)


@pytest.fixture(scope="module")
def bf16_model(checkpoint):
    return checkpoint("qwen3_moe", **MODEL)


@needs_cpp
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8", "int4", "mxfp4"])
def test_whole_model_kernels_equal_torch_path(fmt, bf16_model, tmp_path, monkeypatch):
    params = {"fp8": {"block_size": 32}, "int8": {"group_size": 24}, "int4": {"group_size": 16}}.get(fmt, {})
    path = bf16_model if fmt == "bf16" else quantize_checkpoint(bf16_model, tmp_path / fmt, fmt, **params)
    fast = LLM(str(path))
    assert kernels.backend() == "cpp"
    parts = {t.dtype for t in fast.experts.pools[fast.source.layers[0]].values()}
    assert torch.float32 not in parts or fmt != "bf16", "a bf16 model's expert pools stay bf16"
    assert fast.model.lm_head.dtype == torch.bfloat16  # dense weights read as stored
    got = fast.logits(SEQ)
    with monkeypatch.context() as mp:
        _no_extension(mp, "disabled by the test")
        slow = LLM(str(path))
        assert slow.model.lm_head.dtype == torch.float32
        want = slow.logits(SEQ)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_cpp
@pytest.mark.parametrize("fmt,stored,agree", [("int8", torch.int8, 0.9), ("int4", torch.uint8, 0.5)])
def test_lm_head_quantized_against_float64_and_the_torch_path(fmt, stored, agree, bf16_model, monkeypatch):
    """--lm-head int8|int4: logits = final hidden @ dequantize(lm_head)^T, through the kernels and the torch path."""
    from expertcache.layers.basic import QuantizedWeight, load_quant_method

    llm = LLM(str(bf16_model), lm_head=fmt)
    qw = llm.model.lm_head
    assert isinstance(qw, QuantizedWeight) and qw.parts["w.weight"].dtype == stored
    assert qw.spec is not None  # read by the kernels, not dequantized per use
    assert any(line.startswith(f"lm_head: {fmt} (group 128)") for line in llm.plan_lines)
    x = torch.randn(3, qw.shape[1])
    w = qw.method.dequantize(qw.parts, "w").double()
    ref = x.double() @ w.T
    _close(qw.linear(x), ref, x.double().abs() @ w.abs().T)
    with monkeypatch.context() as mp:
        _no_extension(mp, "disabled by the test")
        _close(qw.linear(x), ref, x.double().abs() @ w.abs().T)
    plain = LLM(str(bf16_model))
    a, b = llm.logits(SEQ), plain.logits(SEQ)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > agree  # close to, not equal to, bf16
    with pytest.raises(ValueError, match="lm_head: unknown format 'int3'"):
        load_quant_method("int3")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dense_quantized_equals_a_checkpoint_holding_the_dequantized_projections(fmt, bf16_model, tmp_path):
    """--dense int8|int4: every attention projection quantized at load (group 128) computes as a checkpoint
    whose q/k/v/o weights are replaced by their dequantized values (float32; the rest as stored)."""
    import checkpoints
    from safetensors.torch import save_file

    from expertcache.layers.basic import QuantizedWeight, load_quant_method

    m = load_quant_method(fmt)
    tensors = checkpoints.read_tensors(bf16_model)
    proj = [n for n in tensors if ".self_attn." in n and n.endswith("_proj.weight")]
    assert len(proj) == 4 * MODEL["num_hidden_layers"]
    for n in proj:
        tensors[n] = m.dequantize(m.pack({"w.weight": tensors[n].float()}), "w").contiguous()
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(bf16_model, ref_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(bf16_model), dense=fmt)
    w = llm.model.layers[0]["attn"].w
    assert all(isinstance(w[k], QuantizedWeight) for k in w if k.endswith("proj.weight"))
    assert any(
        line.startswith(
            f"dense projections: {fmt} (group 128), quantized at load: {2 * MODEL['num_hidden_layers']} "
            "matrices"
        )
        for line in llm.plan_lines
    )
    got, want = llm.logits(SEQ), LLM(str(ref_dir)).logits(SEQ)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert not torch.equal(got, LLM(str(bf16_model)).logits(SEQ))  # the projections were quantized
    with pytest.raises(ValueError, match="dense: unknown format 'int3'"):
        LLM(str(bf16_model), dense="int3")
