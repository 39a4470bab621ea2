"""Hybrid linear-attention MoE (Qwen3-Next, Qwen3.5-MoE) against transformers.

Tiny random checkpoints: 3 Gated DeltaNet layers + 1 gated full-attention layer, GQA in both
mixers, partial rotary, zero-centred norms, 8 experts top-2 with a gated shared expert. Each
engine path (batching, chunked prefill, preemption, a tight expert budget, fused expert layout)
must give transformers' fp32 logits (1e-4) and greedy tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import checkpoints as C
import pytest
import torch
import torch.nn.functional as F
from safetensors_reference import independent_slot_checks

from expertcache import LLM, SamplingParams
from expertcache.engine.kv_cache import KVCache
from expertcache.engine.state_cache import StateCache
from expertcache.errors import ConfigError
from expertcache.layers.gated_deltanet import chunked_delta_rule, l2norm, recurrent_step


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


ATOL = RTOL = 1e-4
NEW_TOKENS = 24
PROMPT = torch.randint(
    3, C.tokenizer_vocab_size(), (21,), generator=torch.Generator().manual_seed(7)
).tolist()
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@dataclasses.dataclass
class Model:
    family: str
    path: Path
    reference: object
    llm: LLM
    greedy: dict = dataclasses.field(default_factory=dict)

    def expected(self, prompt):
        key = tuple(prompt)
        if key not in self.greedy:
            self.greedy[key] = C.reference_greedy(self.reference, list(prompt), NEW_TOKENS)
        return self.greedy[key]


@pytest.fixture(scope="module", params=C.HYBRID_FAMILIES)
def model(request, checkpoint):
    path = checkpoint(request.param)
    return Model(request.param, path, C.load_reference(path), LLM(str(path), device="cpu"))


def prompts():
    """Three prompts of different lengths (21, 5, 37): not multiples of the chunk sizes below."""
    return [PROMPT, PROMPT[:5], PROMPT[4:] + PROMPT[:20]]


def test_layout_is_hybrid(model):
    cfg = model.llm.cfg
    assert cfg.linear_attn.layers == (True, True, True, False)
    assert len(model.llm.kv.tensors) == 1  # KV blocks only for the full-attention layer
    assert set(model.llm.states.layers) == {0, 1, 2}


def test_logits_match_transformers(model):
    expected = C.reference_logits(model.reference, PROMPT)
    torch.testing.assert_close(model.llm.logits(PROMPT), expected, atol=ATOL, rtol=RTOL)


def test_greedy_matches_transformers(model):
    out = model.llm.generate([PROMPT], GREEDY)[0]
    assert list(out.token_ids) == model.expected(PROMPT)


def test_batch_equals_one_by_one(model):
    """Different lengths decoded together: each equals transformers on it alone."""
    outs = model.llm.generate(prompts(), GREEDY)
    for p, out in zip(prompts(), outs):
        assert list(out.token_ids) == model.expected(p), f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("chunk", [4, 7])
def test_chunked_prefill_equals_unchunked(model, chunk):
    """The state carries across prefill chunks (chunk sizes that do not divide the prompts), with
    decodes of other sequences in the same steps."""
    llm = LLM(str(model.path), device="cpu", max_num_batched_tokens=chunk, max_num_seqs=2)
    torch.testing.assert_close(
        llm.logits(PROMPT), C.reference_logits(model.reference, PROMPT), atol=ATOL, rtol=RTOL
    )
    for p, out in zip(prompts(), llm.generate(prompts(), GREEDY)):
        assert list(out.token_ids) == model.expected(p), f"prompt of {len(p)} tokens, chunk {chunk}"


def test_preemption_restores_state(model):
    """A KV cache too small for all sequences preempts (blocks and state slot freed); the sequence is
    recomputed from token 0 with a fresh state and still gives the same tokens."""
    llm = model.llm
    per_block = KVCache.bytes_per_block(
        len(llm.cfg.attention_layer_ids), 4, llm.cfg.kv_token_shapes, llm.dtype
    )
    many = [PROMPT[i:] + PROMPT[:i] for i in range(0, 20, 4)]
    tight = LLM(str(model.path), device="cpu", max_model_len=64, block_size=4, kv_cache_memory=per_block * 20)
    got = [list(o.token_ids) for o in tight.generate(many, GREEDY)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == [model.expected(p) for p in many]
    assert tight.states.num_free == tight.states.num_slots and tight.kv.num_free == tight.kv.num_blocks


def test_tight_expert_budget_equals_resident(model):
    """2 of 8 experts per layer in the fastest tier (the rest from host RAM): same logits and tokens."""
    llm = LLM(str(model.path), device="cpu", device_memory="25%", host_memory="100%")
    try:
        assert llm.experts.stats()["hits"] + llm.experts.stats()["misses"] == 0
        torch.testing.assert_close(llm.logits(PROMPT), model.llm.logits(PROMPT), atol=1e-5, rtol=1e-5)
        assert [list(o.token_ids) for o in llm.generate(prompts(), GREEDY)] == [
            model.expected(p) for p in prompts()
        ]
        assert llm.experts.stats()["misses"] > 0
    finally:
        llm.close()


def test_fused_expert_layout(model, tmp_path):
    fused = C.to_fused_layout(model.path, tmp_path / "fused")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in C.tensor_files(fused))
    torch.testing.assert_close(
        LLM(str(fused), device="cpu").logits(PROMPT), model.llm.logits(PROMPT), atol=1e-5, rtol=1e-5
    )


def test_prefix_caching_is_refused_with_a_note(model, capsys):
    llm = LLM(str(model.path), device="cpu", prefix_caching=True)
    assert "prefix caching is off for hybrid" in capsys.readouterr().err
    assert not llm.kv.prefix_caching
    first, again = llm.generate([PROMPT], GREEDY)[0], llm.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == 0 and list(again.token_ids) == list(first.token_ids) == model.expected(
        PROMPT
    )


def test_state_bytes_independent_of_context(model):
    cfg, llm = model.llm.cfg, model.llm
    la = cfg.linear_attn
    per_layer = (la.conv_kernel - 1) * la.conv_dim * 4 + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4
    assert StateCache.bytes_per_sequence(cfg, torch.float32) == 3 * per_layer
    conv, rec = llm.states.layers[0]
    assert conv[0].numel() * 4 + rec[0].numel() * 4 == per_layer
    assert any("linear-attention state" in line for line in llm.plan_lines)


def test_qwen3_next_dense_layers(checkpoint):
    """decoder_sparse_step / mlp_only_layers give dense SwiGLU layers; a custom layer_types order."""
    path = checkpoint(
        "qwen3_next",
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    llm = LLM(str(path), device="cpu")
    assert llm.cfg.moe_layers == (False, True, False, False)
    assert llm.cfg.attention_layer_ids == [1, 3]
    torch.testing.assert_close(
        llm.logits(PROMPT), C.reference_logits(C.load_reference(path), PROMPT), atol=ATOL, rtol=RTOL
    )


def test_bad_layer_types_named(checkpoint, tmp_path):
    path = C.copy_checkpoint(checkpoint("qwen3_5_moe"), tmp_path / "bad")
    C.edit_config(path, layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"])
    with pytest.raises(ConfigError, match="layer_types"):
        LLM(str(path), device="cpu")


def test_chunked_form_equals_recurrent_form():
    """The prefill (chunked) and decode (recurrent) forms against a float64 token-by-token loop,
    with a non-zero initial state and lengths that do not fill the last chunk."""
    g = torch.Generator().manual_seed(0)
    B, H, L, Dk, Dv = 2, 3, 45, 16, 8

    def rnd(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    q, k, v = l2norm(rnd(B, H, L, Dk)) * Dk**-0.5, l2norm(rnd(B, H, L, Dk)), rnd(B, H, L, Dv)
    decay, beta = -F.softplus(rnd(B, H, L)) * 2, torch.sigmoid(rnd(B, H, L))
    s0 = rnd(B, H, Dk, Dv) * 0.3
    state, ref = s0.clone(), []
    for t in range(L):  # the delta rule written out: S <- a S + k (beta (v - a S^T k))^T
        a = decay[:, :, t].exp()[..., None, None]
        kt, vt = k[:, :, t], v[:, :, t]
        err = vt - torch.einsum("bhkv,bhk->bhv", a * state, kt)
        state = a * state + torch.einsum("bhk,bhv->bhkv", kt, beta[:, :, t, None] * err)
        ref.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    ref = torch.stack(ref, 2)
    f32 = [x.float() for x in (q, k, v, decay, beta)]
    out, fin = chunked_delta_rule(*f32, s0.float(), chunk=16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fin.double(), state, atol=1e-5, rtol=1e-5)
    st, steps = s0.float(), []
    for t in range(L):
        o, st = recurrent_step(*(x[:, :, t] for x in f32), st)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 2), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, fin, atol=1e-5, rtol=1e-5)


def test_plan_counts_state_and_attention_kv(model, capsys):
    import json

    from expertcache.cli import main

    assert main(["plan", str(model.path), "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    c = model.llm.cfg
    assert kv["bytes_per_token"] == 2 * 1 * c.num_kv_heads * c.head_dim * 4  # one full-attention layer
    assert kv["state_bytes_per_sequence"] == StateCache.bytes_per_sequence(c, torch.float32) > 0
    assert main(["plan", str(model.path)]) == 0
    assert "linear-attention state:" in capsys.readouterr().out


def test_n_samples_copy_the_prompt_state(model):
    """n > 1: the siblings forked after the prompt get a copy of its state (greedy: all equal)."""
    outs = model.llm.generate(
        [PROMPT], SamplingParams(n=3, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert [o.index for o in outs] == [0, 1, 2]
    assert [list(o.token_ids) for o in outs] == [model.expected(PROMPT)] * 3
    assert model.llm.states.num_free == model.llm.states.num_slots


def test_qwen35_multimodal_checkpoint_reads_the_text_model(tmp_path):
    """The hub layout of Qwen3.5-MoE: Qwen3_5MoeForConditionalGeneration (text_config, tensors under
    model.language_model.*, a vision tower) plus an mtp.* head; the text model's logits are transformers'."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = C.hf_config("qwen3_5_moe").to_dict()
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        patch_size=4,
        num_position_embeddings=16,
    )
    torch.manual_seed(0)
    ref = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    C.randomize_(ref, 3)
    path = tmp_path / "qwen35-vl"
    ref.save_pretrained(path)
    C.write_generation_config(path)
    C.rewrite_tensors(path, lambda t: {**t, "mtp.fc.weight": torch.zeros(4, 4)})
    names = C.tensor_files(path)
    assert any(k.startswith("model.language_model.layers.") for k in names) and any(
        k.startswith("model.visual.") for k in names
    )
    llm = LLM(str(path), device="cpu")
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(llm.logits(PROMPT), expected, atol=ATOL, rtol=RTOL)
    assert "model.visual.pos_embed.weight" not in llm.index and "mtp.fc.weight" not in llm.index
    from expertcache.cli import main

    assert main(["plan", str(path)]) == 0  # headers only, the same names


def test_quantized_experts_under_a_tight_budget(model, tmp_path):
    """`expertcache quantize` on a hybrid checkpoint (int8 experts): tight tiers == the same model resident."""
    from expertcache.quantize.rewrite import quantize_checkpoint

    q = quantize_checkpoint(model.path, tmp_path / "int8", "int8", group_size=16)
    resident = LLM(str(q), device="cpu")
    tight = LLM(str(q), device="cpu", device_memory="25%", host_memory="25%", verify=True)
    try:
        torch.testing.assert_close(tight.logits(PROMPT), resident.logits(PROMPT), atol=1e-5, rtol=1e-5)
        assert [o.token_ids for o in tight.generate(prompts(), GREEDY)] == [
            o.token_ids for o in resident.generate(prompts(), GREEDY)
        ]
        assert tight.experts.stats()["misses"] > 0
        # int8 experts stay close to the fp32 model (logits of magnitude ~1-5)
        assert (resident.logits(PROMPT) - model.llm.logits(PROMPT)).abs().mean() < 0.05
    finally:
        tight.close()


def test_failed_step_recomputes_the_survivors_state(model, monkeypatch):
    """A step that raises after the layers ran (states already advanced): the sequence at fault ends
    with the error; the others restart from token 0 and still give transformers' tokens."""
    llm = LLM(str(model.path), device="cpu")
    runner, real, victim = llm.engine.runner, llm.engine.runner.run_rows, {}

    def run_rows(work, full):
        out = real(work, full)
        if any(seq.request_id == victim.get("id") and len(seq.generated) == 2 for seq, _ in work):
            raise RuntimeError("kernel exploded")
        return out

    monkeypatch.setattr(runner, "run_rows", run_rows)
    seqs = [llm.engine.add_request(p, GREEDY) for p in prompts()]
    victim["id"] = seqs[0].request_id
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seqs[0].finish_reason.startswith("error: the model step failed")
    for s, p in zip(seqs[1:], prompts()[1:]):
        assert s.finish_reason == "length" and s.generated == model.expected(p)
    assert llm.states.num_free == llm.states.num_slots
