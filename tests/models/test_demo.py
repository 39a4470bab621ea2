"""The random-weight demo checkpoint: format (checked against transformers), determinism, caching."""

from __future__ import annotations

import json
import logging
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from expertcache import demo

transformers = pytest.importorskip("transformers")

SMALL = dict(
    num_layers=2,
    num_experts=4,
    top_k=2,
    hidden=64,
    moe_intermediate=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    num_shards=2,
)
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERT_RE = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory) -> pathlib.Path:
    return demo.build_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="module")
def hf_model(default_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        default_dir, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def _tensor_bytes(model_dir: pathlib.Path) -> dict[str, int]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                assert sl.get_dtype() == "BF16", name
                n = 1
                for d in sl.get_shape():
                    n *= d
                out[name] = 2 * n
    return out


def test_layout_names_and_byte_fraction(default_dir):
    cfg = json.loads((default_dir / "config.json").read_text())
    L, E, H, I, V = 8, 32, 256, 256, cfg["vocab_size"]
    assert (cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (L, E, 4)
    assert 2048 <= V <= 4096
    index = json.loads((default_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in default_dir.glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == shards
    sizes = _tensor_bytes(default_dir)
    assert set(sizes) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(sizes.values())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(L):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {p + "mlp.gate.weight", p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"mlp.experts.{j}.{x}_proj.weight" for j in range(E) for x in ("gate", "up", "down")}
    assert set(sizes) == expected
    with safe_open(str(default_dir / index["weight_map"]["model.layers.0.mlp.gate.weight"]), "pt") as st:
        assert st.metadata() == {"format": "pt"}
        assert list(st.get_slice("model.layers.0.mlp.gate.weight").get_shape()) == [E, H]
    down = "model.layers.0.mlp.experts.3.down_proj.weight"
    with safe_open(str(default_dir / index["weight_map"][down]), "pt") as st:
        assert list(st.get_slice(down).get_shape()) == [H, I]
        assert list(st.get_slice("model.layers.0.mlp.experts.3.up_proj.weight").get_shape()) == [I, H]
    expert = sum(n for k, n in sizes.items() if EXPERT_RE.fullmatch(k))
    assert expert == L * E * 3 * H * I * 2
    assert expert / sum(sizes.values()) >= 0.80


def test_config_is_what_transformers_writes(default_dir, tmp_path):
    ours = json.loads((default_dir / "config.json").read_text())
    ref = transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=8,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        hidden_size=256,
        moe_intermediate_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        vocab_size=ours["vocab_size"],
        max_position_embeddings=4096,
        dtype="bfloat16",
        eos_token_id=0,
        pad_token_id=0,
        initializer_range=0.02,
    )
    ref.save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    theirs.pop("transformers_version")
    legacy = {"num_experts": 32, "rope_theta": 10000.0}  # hub-era keys we add
    assert ours == {**theirs, **legacy}
    gen = json.loads((default_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 2]


def test_transformers_loads_and_runs(default_dir, hf_model):
    model, info = hf_model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(default_dir)
    ids = tok(demo.CORPUS[:4000], return_tensors="pt").input_ids[:, :400]
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        gen = model.generate(ids[:, :8], max_new_tokens=8, do_sample=False)
    assert torch.isfinite(out.logits).all()
    assert 0.05 < out.logits.std().item() < 5
    assert gen.shape[1] == 16
    # Routing is skewed and sticky, not uniform: for top-4 of 32 a uniform router gives the
    # 4 busiest experts 12.5% of picks and a 12.5% overlap with the previous token.
    top_share, reuse = [], []
    for rl in out.router_logits:
        picks = rl.reshape(-1, 32).topk(4, dim=-1).indices
        counts = torch.bincount(picks.flatten(), minlength=32).float()
        top_share.append((counts.sort(descending=True).values[:4].sum() / counts.sum()).item())
        onehot = torch.zeros(picks.shape[0], 32).scatter_(1, picks, 1.0)
        reuse.append(((onehot[1:] * onehot[:-1]).sum(1).mean() / 4).item())
        assert (counts > 0).sum() >= 16  # most experts still get used
    assert sum(top_share) / len(top_share) > 0.25
    assert sum(reuse) / len(reuse) > 0.2


def test_tokenizer_round_trip_and_chat_template(default_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(default_dir / "tokenizer.json"))
    text = "Hello, world! def f(x):\n    return x * 2  # ünïcödé 42"
    assert raw.decode(raw.encode(text).ids) == text
    assert [raw.token_to_id(t) for t in demo.SPECIAL_TOKENS] == [0, 1, 2]
    assert raw.get_vocab_size() == json.loads((default_dir / "config.json").read_text())["vocab_size"]

    tok = transformers.AutoTokenizer.from_pretrained(default_dir)
    assert tok.decode(tok(text).input_ids) == text
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|endoftext|>", 0, 0)
    ids = tok("<|im_start|>user\nhi<|im_end|>").input_ids
    assert ids[0] == 1 and ids[-1] == 2
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("assistant\n")


def test_deterministic(default_dir, tmp_path):
    again = demo.build_demo_model(tmp_path / "again")
    a = json.loads((default_dir / demo.MANIFEST).read_text())
    b = json.loads((again / demo.MANIFEST).read_text())
    assert a == b
    assert demo.check_demo_model(again, deep=True) is None
    other = json.loads((demo.build_demo_model(tmp_path / "s1", seed=1, **SMALL) / demo.MANIFEST).read_text())
    small = json.loads((demo.build_demo_model(tmp_path / "s0", **SMALL) / demo.MANIFEST).read_text())
    assert other["files"]["tokenizer.json"] == small["files"]["tokenizer.json"]
    shard = "model-00001-of-00002.safetensors"
    assert other["files"][shard] != small["files"][shard]


def test_overrides(tmp_path):
    sizes = {**SMALL, "num_shards": 1, "vocab": 2100}
    out = demo.build_demo_model(tmp_path / "one", **sizes)
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    got = (cfg["num_hidden_layers"], cfg["num_experts"], cfg["hidden_size"], cfg["vocab_size"])
    assert got == (2, 4, 64, 2100)
    with pytest.raises(TypeError, match="unknown size override"):
        demo.build_demo_model(tmp_path / "bad", layers=3)
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        demo.build_demo_model(tmp_path / "bad", num_experts=4, top_k=5)
    with pytest.raises(FileExistsError):
        demo.build_demo_model(out)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path / "a"))
    assert demo.cache_root() == tmp_path / "a"
    monkeypatch.delenv("EXPERTCACHE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert demo.cache_root() == tmp_path / "x" / "expertcache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert demo.cache_root() == tmp_path / "h" / ".cache" / "expertcache"


def _truncate(p: pathlib.Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip_header_byte(p: pathlib.Path) -> None:
    data = bytearray(p.read_bytes())
    i = data.index(b"model.")  # a byte of a tensor name inside the JSON header
    data[i] = ord("M")
    p.write_bytes(bytes(data))


def _flip_json_byte(p: pathlib.Path) -> None:
    p.write_text(p.read_text().replace('"hidden_act": "silu"', '"hidden_act": "gelu"'))


DAMAGE = {
    "truncated shard": ("model-00002-of-00002.safetensors", _truncate, "bytes, manifest says"),
    "corrupt header": ("model-00001-of-00002.safetensors", _flip_header_byte, "safetensors header differs"),
    "edited config": ("config.json", _flip_json_byte, "config.json: sha256 differs"),
    "deleted tokenizer": ("tokenizer.json", pathlib.Path.unlink, "tokenizer.json is missing"),
    "deleted manifest": (demo.MANIFEST, pathlib.Path.unlink, "is missing or unreadable"),
}


@pytest.fixture
def small_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path))
    for k, v in SMALL.items():
        monkeypatch.setitem(demo.DEFAULT_SIZES, k, v)
    builds = []
    real = demo.build_demo_model
    monkeypatch.setattr(demo, "build_demo_model", lambda out, **kw: builds.append(out) or real(out, **kw))
    return tmp_path, builds


@pytest.mark.parametrize("case", list(DAMAGE))
def test_random_demo_dir_rebuilds_damage(small_cache, case, caplog):
    root, builds = small_cache
    path = demo.random_demo_dir(progress=False)
    assert path == root / demo.DEMO_NAME and len(builds) == 1
    assert demo.random_demo_dir(progress=False) == path and len(builds) == 1  # cached
    fname, damage, reason = DAMAGE[case]
    damage(path / fname)
    assert reason in demo.check_demo_model(path)
    with caplog.at_level(logging.WARNING, logger="expertcache.demo"):
        assert demo.random_demo_dir(progress=False) == path
    assert len(builds) == 2 and reason in caplog.text
    assert demo.check_demo_model(path, deep=True) is None
    assert sorted(p.name for p in root.iterdir()) == [demo.DEMO_NAME, f"{demo.DEMO_NAME}.lock"]


def test_random_demo_dir_refuses_a_directory_others_can_write(small_cache):
    """The demo checkpoint is loaded from the cache as the kernels are: only from directories this user owns
    that group and others cannot write (a shared /tmp cache could otherwise hand over another checkpoint)."""
    from expertcache.paths import UnsafeDirectoryError

    root, builds = small_cache
    path = demo.random_demo_dir(progress=False)
    path.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match=f"{path} is writable by group or others"):
        demo.random_demo_dir(progress=False)
    path.chmod(0o755)
    root.chmod(0o775)
    with pytest.raises(UnsafeDirectoryError, match=f"{root} is writable by group or others"):
        demo.random_demo_dir(progress=False)
    root.chmod(0o755)
    assert demo.random_demo_dir(progress=False) == path and len(builds) == 1


def test_random_demo_dir_refuses_another_owner_and_writable_files(small_cache, monkeypatch):
    """As the kernel cache (paths.check_private): a demo directory or file of another user, or a file
    group or others can write, is refused before anything is read from it; a fresh build's files are
    0644 whatever the umask."""
    import os

    from expertcache import paths
    from expertcache.paths import UnsafeDirectoryError

    _, builds = small_cache
    umask = os.umask(0o002)  # a umask that would leave the files group-writable
    try:
        path = demo.random_demo_dir(progress=False)
    finally:
        os.umask(umask)
    files = sorted(path.iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o644 for f in files)
    me = os.getuid()
    with monkeypatch.context() as m:
        m.setattr(paths.os, "getuid", lambda: me + 1)
        with pytest.raises(UnsafeDirectoryError, match=f"owned by user id {me}, not by this user"):
            demo.random_demo_dir(progress=False)
    victim = path / "config.json"
    victim.chmod(0o666)
    with pytest.raises(UnsafeDirectoryError, match=f"cache file {victim} is writable by group or others"):
        demo.random_demo_dir(progress=False)
    victim.chmod(0o644)
    assert demo.random_demo_dir(progress=False) == path and len(builds) == 1


def test_random_demo_dir_rebuild_flag_params_and_interruption(small_cache, monkeypatch):
    root, builds = small_cache
    path = demo.random_demo_dir(progress=False)
    demo.random_demo_dir(rebuild=True, progress=False)
    assert len(builds) == 2 and demo.check_demo_model(path) is None
    monkeypatch.setitem(demo.DEFAULT_SIZES, "num_experts", 6)  # a newer default => rebuild
    demo.random_demo_dir(progress=False)
    assert len(builds) == 3 and json.loads((path / "config.json").read_text())["num_experts"] == 6

    def crash(out, **kw):
        (pathlib.Path(out) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "build_demo_model", crash)
    (root / f".{demo.DEMO_NAME}.tmp-killed").mkdir()  # left by a killed build: cleaned up
    with pytest.raises(KeyboardInterrupt):
        demo.random_demo_dir(rebuild=True, progress=False)
    assert demo.check_demo_model(path) is None  # the old copy is untouched
    assert sorted(p.name for p in root.iterdir()) == [demo.DEMO_NAME, f"{demo.DEMO_NAME}.lock"]


def test_no_transformers_at_runtime(tmp_path):
    code = (
        "import sys, expertcache.demo as d; d.build_demo_model(sys.argv[1], num_layers=1, num_experts=2, "
        "top_k=1, hidden=32, moe_intermediate=16, num_heads=1, num_kv_heads=1, head_dim=32); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], check=True, cwd=ROOT)
