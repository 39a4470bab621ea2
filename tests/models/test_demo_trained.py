"""The trained demo model: its training script runs (a few steps, tiny sizes) and writes a checkpoint
whose math is Qwen3-MoE's (trainer forward == transformers == the engine); the shipped weights load,
match transformers, and predict held-out text from their corpus far better than chance."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from expertcache import LLM, demo
from expertcache import demo_train as T

transformers = pytest.importorskip("transformers")

# The shipped model measures 9.6 on the first 1024 held-out tokens (13.6 on the manifest's 32 windows);
# the previous, shorter-trained model measured 45, random weights ~2050, experts moved one router row ~13000.
PPL_CEILING = 16.0
SHUFFLED_RATIO = 10.0
TINY = dict(
    num_layers=2,
    num_experts=4,
    top_k=2,
    hidden=32,
    moe_intermediate=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    vocab=300,
)


def _hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "README.md").write_text(
        "# Tiny\n\nAn expert cache keeps the experts that will be needed next.\n" * 20
    )
    (root / "expertcache").mkdir()
    for i in range(3):
        (root / "expertcache" / f"m{i}.py").write_text(
            f'"""Module {i}: counts things."""\n\n\ndef count_{i}(xs):\n    """Count the items of xs."""\n'
            f"    return len(xs) + {i}\n" * 10
        )
    out = tmp_path_factory.mktemp("trained") / "model"
    logs: list[str] = []
    info = T.train(
        root, out, minutes=None, steps=3, batch=2, seq=32, sizes=TINY, probe_every=2, log=logs.append
    )
    return root, out, info, logs


def test_training_script_writes_a_checked_checkpoint(tiny_run):
    root, out, info, logs = tiny_run
    assert [line.split(" held_loss")[0] for line in logs if line.startswith("probe")] == [
        "probe step 0",
        "probe step 2",
    ]
    assert 0 <= info["held_out_reuse"] <= 1 and 0 < info["held_out_load_entropy"] <= 1
    assert info["steps"] == 3 and info["files"] == 4 and info["held_out_files"] == ["expertcache/m2.py"]
    assert demo.check_demo_model(out, deep=True) is None
    assert {f.name for f in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "heldout.txt",
        "tokenizer_config.json",
        demo.MANIFEST,
    }
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())
    assert "count_2" in (out / "heldout.txt").read_text()  # the held-out file, not trained on
    pairs = T.chat_pairs("expertcache/m0.py", (root / "expertcache" / "m0.py").read_text())
    assert any("What does the function `count_0` do?" in p and "Count the items of xs." in p for p in pairs)


def test_trainer_math_is_qwen3_moe(tiny_run):
    """The trainer's forward (weights rounded to the stored bf16) equals transformers' Qwen3-MoE on the
    written checkpoint, and the engine agrees: the trained weights mean the same thing everywhere."""
    root, out, _, _ = tiny_run
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    vocab = tensors["lm_head.weight"].shape[0]
    model = T.TinyMoE({**T.SIZES, **TINY, "seed": 0}, vocab, seed=123)  # other init, then the stored values
    with torch.no_grad():
        names = model.hub_tensors().keys()
        assert set(names) == set(tensors)
        model.embed.copy_(tensors["model.embed_tokens.weight"].float())
        model.lm_head.copy_(tensors["lm_head.weight"].float())
        model.norm.copy_(tensors["model.norm.weight"].float())
        for i, m in enumerate(model.layers):
            pre = f"model.layers.{i}."
            for attr, name in (
                ("ln1", "input_layernorm"),
                ("ln2", "post_attention_layernorm"),
                ("q_norm", "self_attn.q_norm"),
                ("k_norm", "self_attn.k_norm"),
                ("q", "self_attn.q_proj"),
                ("k", "self_attn.k_proj"),
                ("v", "self_attn.v_proj"),
                ("o", "self_attn.o_proj"),
                ("router", "mlp.gate"),
            ):
                getattr(m, attr).copy_(tensors[pre + name + ".weight"].float())
            for proj in ("gate", "up", "down"):
                getattr(m, proj).copy_(
                    torch.stack(
                        [
                            tensors[pre + f"mlp.experts.{j}.{proj}_proj.weight"].float()
                            for j in range(TINY["num_experts"])
                        ]
                    )
                )
    ids = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 1, 2, 33]
    with torch.no_grad():
        ours, _, _ = model(torch.tensor([ids]))
    ref = _hf_logits(out, ids)
    torch.testing.assert_close(ours[0], ref, atol=2e-4, rtol=1e-4)
    llm = LLM(str(out))
    torch.testing.assert_close(llm.logits(ids), ref, atol=2e-4, rtol=1e-4)
    llm.close()


def test_routing_probe_matches_a_brute_force_count():
    """held_out_eval's reuse and load entropy equal a plain count over the routes the model chose."""
    torch.manual_seed(0)
    model = T.TinyMoE({**T.SIZES, **TINY, "seed": 0}, 300, seed=7)
    ids = torch.randint(0, 300, (3 * 16 + 1,))
    ev = T.held_out_eval(model, ids, seq=16)
    routes: list[torch.Tensor] = []
    with torch.no_grad():
        model(ids[:48].view(3, 16), routes)
    K, E = TINY["top_k"], TINY["num_experts"]
    shares, ents = [], []
    for r in routes:  # [3*16, K] per layer
        sets = [set(row) for row in r.tolist()]
        shares += [len(sets[i] & sets[i - 1]) / K for i in range(len(sets)) if i % 16]
        counts = [sum(e in s for s in sets) for e in range(E)]
        ents.append(-sum(c / sum(counts) * math.log(c / sum(counts)) for c in counts if c) / math.log(E))
    assert ev["reuse"] == pytest.approx(sum(shares) / len(shares), abs=1e-6)
    assert ev["entropy"] == pytest.approx(sum(ents) / len(ents), abs=1e-6)


@pytest.fixture(scope="module")
def shipped():
    return demo.demo_model_dir()


def test_shipped_model_passes_its_manifest_and_matches_transformers(shipped):
    assert demo.check_demo_model(shipped, deep=True) is None
    assert sum(f.stat().st_size for f in shipped.iterdir()) < 40 * 2**20
    line = demo.describe(shipped)
    assert line.startswith("a tiny Qwen3-MoE (6 layers x 32 experts, top-4") and "own docs and source" in line
    llm = LLM(str(shipped))
    ids = llm.tokenizer.encode((shipped / "heldout.txt").read_text()[:400])[:64]
    torch.testing.assert_close(llm.logits(ids), _hf_logits(shipped, ids), atol=1e-3, rtol=1e-3)
    llm.close()


def _held_out_ppl(path, shipped) -> float:
    """Perplexity of the checkpoint at `path` on the first 1024 tokens of the shipped held-out text."""
    llm = LLM(str(path))
    ids = llm.tokenizer.encode((shipped / "heldout.txt").read_text())[:1024]
    lp = torch.log_softmax(llm.logits(ids), -1)
    llm.close()
    return math.exp(-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item())


def _variant(shipped, out: pathlib.Path, tensors=None) -> pathlib.Path:
    """A copy of the shipped checkpoint (without its manifest), optionally with other tensors."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    for f in shipped.iterdir():
        if f.name not in (demo.MANIFEST, "model.safetensors"):
            shutil.copy(f, out / f.name)
    if tensors is None:
        shutil.copy(shipped / "model.safetensors", out / "model.safetensors")
    else:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def shipped_ppl(shipped):
    return _held_out_ppl(shipped, shipped)


def test_shipped_model_predicts_held_out_text(shipped, shipped_ppl, tmp_path):
    """Perplexity on text of files it was not trained on: what training measured (the manifest's
    figure, and at most PPL_CEILING), and far below a random-weight model of the same shape and tokens."""
    manifest_ppl = demo.json.loads((shipped / demo.MANIFEST).read_text())["training"]["held_out_ppl"]
    assert shipped_ppl < 1.25 * manifest_ppl and shipped_ppl < PPL_CEILING, (shipped_ppl, manifest_ppl)
    p = demo.json.loads((shipped / demo.MANIFEST).read_text())["params"]
    sizes = {
        k: p[k]
        for k in (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden",
            "moe_intermediate",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab",
        )
    }
    rnd_dir = demo.build_demo_model(tmp_path / "random", num_shards=1, **sizes)
    import shutil

    shutil.copy(shipped / "tokenizer.json", rnd_dir / "tokenizer.json")  # same tokens, random weights
    assert _held_out_ppl(rnd_dir, shipped) > 20 * shipped_ppl


def test_shipped_experts_are_specialised(shipped, shipped_ppl, tmp_path):
    """The routers and their experts were learned together: the same weights with the experts of each
    layer handed to the wrong router rows (a fixed derangement) predict the held-out text far worse."""
    from safetensors.torch import load_file

    tensors = load_file(str(shipped / "model.safetensors"))
    E = demo.json.loads((shipped / demo.MANIFEST).read_text())["params"]["num_experts"]
    moved = dict(tensors)
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            pre, rest = name.split(".mlp.experts.")
            j, proj = rest.split(".", 1)
            moved[f"{pre}.mlp.experts.{(int(j) + 1) % E}.{proj}"] = t
    assert _held_out_ppl(_variant(shipped, tmp_path / "moved", moved), shipped) > SHUFFLED_RATIO * shipped_ppl


def test_demo_command_says_what_the_model_is(capsys, shipped):
    from expertcache.cli import main

    assert main(["demo", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "expertcache demo: " + demo.describe(shipped)
    assert any("generated tokens 4" in line and "hit rate" in line for line in err)
