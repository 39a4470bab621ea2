"""Expert parallelism on CPU (gloo): placement and EPLB against brute force, and 2- and 3-rank
engines against the single-process engine (logits, greedy tokens), with redundant experts,
rearrangements in the middle of a generation, tiny per-rank budgets, a killed rank, and the server.

Each multi-rank LLM spawns its workers (fresh interpreters): a few seconds per group.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import types

import pytest
import torch
from safetensors_reference import checkpoint_experts, independent_slot_checks, same_bytes
from serving import free_port

from expertcache import LLM, SamplingParams
from expertcache.parallel import ExpertParallelError, ParallelConfig, balanced_placement, static_placement
from expertcache.parallel.experts import ExpertParallelExperts
from expertcache.parallel.peer import plan_transfers
from expertcache.parallel.placement import (
    Placement,
    assign_ranks,
    balanced_layer,
    capacities,
    coactivation,
    expected_balance,
    rank_loads,
    worth_moving,
)

PROMPTS = [list(range(5, 25)), [7, 3, 9, 11, 40, 41, 42], list(range(60, 97))]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


# -- placement (pure) ---------------------------------------------------------------------------------
def brute_force_max_load(load: list[float], num_ranks: int) -> float:
    """The best max rank load over every assignment of one replica per expert with equal counts per rank."""
    cap = capacities(len(load), num_ranks)
    best = float("inf")
    for assign in itertools.product(range(num_ranks), repeat=len(load)):
        if [assign.count(r) for r in range(num_ranks)] != cap:
            continue
        best = min(best, max(sum(w for w, a in zip(load, assign) if a == r) for r in range(num_ranks)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_packing_near_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    load = (torch.rand(8, generator=g) ** 3 * 100).tolist()
    reps = balanced_layer(load, 2, 0)
    ranks = [0.0, 0.0]
    for e, rs in enumerate(reps):
        assert len(rs) == 1
        ranks[rs[0]] += load[e]
    # greedy heaviest-first packing is within 4/3 of the optimum (Graham's LPT bound)
    assert max(ranks) <= brute_force_max_load(load, 2) * 4 / 3 + 1e-9


def test_redundant_experts_go_to_the_hottest_and_balance_improves():
    load = torch.tensor([[400.0, 10, 10, 10, 10, 10, 10, 200, 5, 5, 5, 5]])
    static = static_placement([0], 12, 3)
    p = balanced_placement(load, [0], 3, 3, version=1)
    p.check()
    reps = p.replicas[0]
    assert len(reps[0]) == 3 and len(reps[7]) == 2  # 400 split three ways, then 200 two ways
    assert all(len(set(r)) == len(r) for r in reps)
    # expected pairs per rank when each token's pairs follow assign_ranks
    ids = torch.multinomial(load[0], 4000, replacement=True, generator=torch.Generator().manual_seed(0))
    ids = ids.view(-1, 1)

    def balance(pl):
        t, c = pl.rank_table(0)
        n = rank_loads(ids, t, c, 3).double()
        return (n.max() / n.mean()).item()

    assert balance(p) < 1.15 and balance(static) > 1.8  # capacity 5 per rank limits the packing


def test_coactivation_and_layers_spread_a_tokens_pairs():
    """Experts that fire together go to different ranks (every token's two pairs on two ranks, the
    brute-force best), and the heaviest expert of each layer does not land on the same rank."""
    ids = torch.tensor([[0, 2], [1, 3], [4, 6], [5, 7]] * 8)  # pairs (0,2), (1,3), ... always together
    load = torch.bincount(ids.reshape(-1), minlength=8).double()
    co = coactivation(ids, 8)
    assert co[0, 2] == 8 and co[0, 1] == 0 and co[0, 0] == 0

    def split(coact):
        t, c = balanced_placement(load.unsqueeze(0), [0], 2, 0, coact=coact).rank_table(0)
        r = assign_ranks(ids, t, c)
        return bool((r[:, 0] != r[:, 1]).all())

    assert split(co.unsqueeze(0)) and not split(None)  # load alone packs 0 and 2 together
    hot = torch.tensor([[50.0, 1, 1, 1], [50.0, 1, 1, 1]])
    p = balanced_placement(hot, [0, 1], 2, 0)
    assert p.replicas[0][0] != p.replicas[1][0]  # layer 1's hottest goes where layer 0's is not


def test_replicas_split_tokens_evenly():
    p = balanced_placement(torch.tensor([[100.0, 1, 1, 1]]), [0], 2, 1)
    t, c = p.rank_table(0)
    ids = torch.zeros(10, 1, dtype=torch.int64)  # every token to expert 0, held by both ranks
    assert assign_ranks(ids, t, c).reshape(-1).bincount(minlength=2).tolist() == [5, 5]


def test_worth_moving_takes_a_placement_only_past_a_5_percent_gain():
    """Hand loads on 2 ranks x 4 experts: current {0,1}|{2,3} has max/mean 150/100 = 1.5; the new
    {0,2}|{1,3} lowers it by 4.9% (1.4265: kept) or 5.1% (1.4235: moved)."""
    cur = Placement(2, {0: ((0,), (0,), (1,), (1,))})
    new = Placement(2, {0: ((0,), (1,), (0,), (1,))})
    for c, gain in ((42.65, 0.049), (42.35, 0.051)):
        load = torch.tensor([[100.0, 50.0, c, 50.0 - c]])
        assert expected_balance(cur, load, [0]) == pytest.approx(1.5)
        assert expected_balance(new, load, [0]) == pytest.approx(1.5 * (1 - gain))
        assert worth_moving(cur, new, load, [0]) is (gain > 0.05)
    # a uniform load: the static split is already perfect, so EPLB's own proposal is never taken
    uniform = torch.full((2, 16), 7.0)
    static = static_placement([0, 1], 16, 2)
    assert not worth_moving(static, balanced_placement(uniform, [0, 1], 2, 2, version=1), uniform, [0, 1])


def _eplb_provider(window_load):
    """Rank 0's ExpertParallelExperts on 2 ranks (no processes: control() only reads its own state)
    with `window_load` [L, E] in its load window and EPLB due at this step."""
    group = types.SimpleNamespace(rank=0, world_size=2)
    local = types.SimpleNamespace(wants_prefetch=False)
    cfg = ParallelConfig(2, num_redundant_experts=2, eplb=True, eplb_window_size=4, eplb_step_interval=5)
    ep = ExpertParallelExperts(group, local, static_placement([0, 1], 16, 2), cfg, [0, 1], 16)
    ep.window.append(window_load)
    ep.steps = 5
    return ep


def test_eplb_control_moves_under_skew_and_stays_under_uniform_load():
    assert _eplb_provider(torch.full((2, 16), 7, dtype=torch.int64)).control() == {}
    skew = torch.ones(2, 16, dtype=torch.int64)
    skew[:, 0] = 200  # expert 0 of each layer on rank 0 gets most of the pairs
    ctl = _eplb_provider(skew).control()
    new = ctl["placement"]
    assert new.version == 1 and len(new.replicas[0][0]) == 2  # the hot expert replicated on both ranks


def test_bad_parallel_options_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="num_redundant_experts"):
        ParallelConfig(1, num_redundant_experts=2)
    with pytest.raises(ValueError, match="eplb_step_interval"):
        ParallelConfig(2, eplb=True, eplb_step_interval=0)
    with pytest.raises(ValueError, match="eplb_window_size=8 is invalid; it only applies with eplb=True"):
        ParallelConfig(2, eplb_window_size=8)  # would be ignored without EPLB: refused


def test_peer_link_in_the_cost_model(tmp_path):
    """peer = latency + bytes / bandwidth, against the disk read it replaces; the fields load from TOML."""
    from expertcache.cost.model import ExpertCost
    from expertcache.cost.profiles import get_profile

    f = tmp_path / "rig.toml"
    f.write_text(
        "link_gbs = 25\ndisk_gbs = 6\ncpu_mem_gbs = 50\ncpu_gflops = 500\npeer_gbs = 300\n"
        "peer_latency_ms = 0.02\n"
    )
    prof = get_profile(str(f))
    cost = ExpertCost(prof, 9_437_184, 1)
    assert cost.peer() == pytest.approx(0.02e-3 + 9_437_184 / 300e9)
    assert cost.peer_faster()  # NVLink-class link vs a 6 GB/s disk
    slow = ExpertCost(get_profile("cpu-only"), 9_437_184, 1)  # no link figure: never faster
    assert slow.peer() == float("inf") and not slow.peer_faster()


@pytest.mark.parametrize("seed", range(4))
def test_peer_plan_against_brute_force(seed):
    """Every planned transfer is needed, only on the receiver's disk and in the sender's memory; no
    receiver gets more than its buffers; nothing fetchable is left out below that cap."""
    g = torch.Generator().manual_seed(seed)
    N, E, T, K, slots = 3, 12, 9, 2, 3
    codes = torch.randint(0, 3, (N, E), generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ranks = torch.randint(0, N, (T, K), generator=g)
    plan = plan_transfers(codes, ids, ranks, slots)
    needs = {(int(r), int(e)) for r, e in zip(ranks.reshape(-1), ids.reshape(-1))}
    got = {}
    for s, r, e in plan:
        assert s != r and (r, e) in needs and codes[r, e] == 0 and codes[s, e] == 2
        got.setdefault(r, []).append(e)
    for r in range(N):
        fetchable = sorted(
            e
            for rr, e in needs
            if rr == r and codes[r, e] == 0 and any(codes[s, e] == 2 for s in range(N) if s != r)
        )
        assert got.get(r, []) == fetchable[:slots]  # in expert order, up to the receive buffers
    assert plan_transfers(codes, ids, ranks, slots) == plan  # the same on every rank


def test_zero_row_lm_head_on_the_kernels():
    """Ranks 1..N-1 run lm_head on no rows: a bf16 weight through the CPU kernels gives [0, V], no crash."""
    from expertcache.layers.basic import linear

    w = torch.randn(64, 32).to(torch.bfloat16)
    y = linear(torch.empty(0, 32), w)
    assert y.shape == (0, 64)
    torch.testing.assert_close(
        linear(torch.ones(1, 32), w), torch.ones(1, 32) @ w.float().T, rtol=1e-3, atol=1e-3
    )


# -- engines ----------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """Rank 0's verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


@pytest.fixture(scope="module")
def ep_checkpoint(checkpoint):
    return checkpoint("qwen3_moe", num_experts=16, num_experts_per_tok=2, num_hidden_layers=3)


@pytest.fixture(scope="module")
def single(ep_checkpoint):
    llm = LLM(str(ep_checkpoint))
    out = {
        "logits": [llm.logits(p) for p in PROMPTS],
        "tokens": [o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
        "samples": _samples(llm),
    }
    llm.close()
    return out


SAMPLED = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=3)  # forks share blocks, copy on write


def _samples(llm):
    return [o.token_ids for o in llm.generate([PROMPTS[2]], SAMPLED)]


def _check_equal(llm, single):
    for p, ref in zip(PROMPTS, single["logits"]):
        torch.testing.assert_close(llm.logits(p), ref, atol=1e-5, rtol=1e-5)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single["tokens"]
    assert _samples(llm) == single["samples"]


def _listening_sockets(pids) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the TCP sockets `pids` listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # state LISTEN
                out.append(f[1])
    return out


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1


@pytest.mark.parametrize("world", [2, 3])  # 3 does not divide the 16 experts
def test_ranks_equal_single_process(ep_checkpoint, single, world, monkeypatch):
    import torch.distributed as dist

    for name in ("broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"rank 0 sent a pickle ({_n})"))
    llm = LLM(str(ep_checkpoint), expert_parallel=world)
    try:
        # the rendezvous is a file store in a private directory, and every rank listens on loopback only
        store = llm.group.store_dir
        assert store.is_dir() and store.stat().st_mode & 0o777 == 0o700 and store.stat().st_uid == os.getuid()
        listening = _listening_sockets([os.getpid()] + [p.pid for p in llm.group.procs])
        assert listening and all(a.startswith(LOOPBACK) for a in listening), listening
        _check_equal(llm, single)
        ep = llm.expert_stats()["expert_parallel"]
        assert ep["world_size"] == world and sum(ep["pairs_per_rank_last_step"]) > 0
        assert {r["rank"] for r in ep["ranks"]} == set(range(world))
    finally:
        llm.close()
    assert not store.exists()  # removed at close


def _generate_switching_at_step_6(llm, placement) -> list[int]:
    """PROMPTS[0] greedily, with `placement` requested in the middle of the generation -> its tokens."""
    seq = llm.engine.add_request(PROMPTS[0], GREEDY)
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
        if steps == 6:
            llm.experts.request_placement(placement)
    return seq.generated


@pytest.mark.parametrize("peer", ["off", "on"])  # a new placement's bytes from disk / from their old ranks
def test_rearrangement_mid_generation_with_replicas(ep_checkpoint, single, peer):
    cfg = ParallelConfig(
        3, num_redundant_experts=4, eplb=True, eplb_window_size=8, eplb_step_interval=5, peer_tier=peer
    )
    llm = LLM(str(ep_checkpoint), expert_parallel=cfg)
    try:
        _check_equal(llm, single)  # EPLB rebalances where the window's load says it pays
        ep = llm.expert_stats()["expert_parallel"]
        assert ep["num_redundant_experts"] == 4
        before = ep["rearrangements"]
        assert before > 0  # EPLB itself rebalanced (the prompts' routing is skewed past the 5% guard)
        # and an arbitrary placement forced in the middle of a generation
        E, layers = 16, llm.source.layers
        worst = balanced_placement(torch.rand(len(layers), E), layers, 3, 4, version=99)
        assert _generate_switching_at_step_6(llm, worst) == single["tokens"][0]
        assert llm.experts.placement.version >= 99  # the forced placement was taken (EPLB continues from it)
        assert llm.experts.rearrangements > before
        ep = llm.expert_stats()["expert_parallel"]
        if peer == "on":  # every byte came from the rank that held the expert
            assert ep["bytes_rearranged_peer"] > 0 and ep["bytes_rearranged"] == 0
        else:
            assert ep["bytes_rearranged"] > 0 and ep["bytes_rearranged_peer"] == 0
        local = llm.experts.local  # rank 0's pools after the moves: the checkpoint's bytes (safetensors)
        ckpt = checkpoint_experts(str(ep_checkpoint))
        for layer, experts in llm.experts.placement.owned(0).items():
            for e in experts:
                ref = ckpt.read(layer, e, list(local.pools[layer]))
                for name, t in local.pools[layer].items():
                    assert same_bytes(t[int(local.slot_of[layer][e])], ref[name]), (layer, e, name)
    finally:
        llm.close()


def test_tiny_per_rank_budgets_equal_single_process(ep_checkpoint, single):
    """Peer tier off: every miss reads this rank's disk."""
    llm = LLM(
        str(ep_checkpoint),
        expert_parallel=ParallelConfig(2, num_redundant_experts=2, peer_tier="off"),
        device_memory="20%",
        host_memory="30%",
    )
    try:
        _check_equal(llm, single)
        s = llm.expert_stats()
        assert s["misses"] > 0  # rank 0's own tiers missed and fetched
        ep = s["expert_parallel"]
        assert all(r["cache"]["misses"] > 0 for r in ep["ranks"])
        assert not ep["peer_tier"] and ep["peer_hits"] == ep["peer_bytes_in"] == 0
        assert llm.experts.peer is None and "peer" not in s["per_tier"]
    finally:
        llm.close()


def _slot_bytes_equal_checkpoint(llm, received) -> int:
    """Rank 0: the stored bytes of each peer-fetched expert still in its memory == the checkpoint's."""
    cache, checked = llm.experts.local, 0
    for layer, e in set(received):
        got = cache.stored_bytes(layer, e)
        if got is None:
            continue
        ref = checkpoint_experts(str(llm.model_dir)).read(layer, e, list(got))
        for name, t in got.items():
            assert same_bytes(t, ref[name]), (layer, e, name)
        checked += 1
    cache.check(contents=True)  # and every slot of both tiers
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_peer_tier_serves_misses_and_equals_single_process(ep_checkpoint, single, world):
    """Tiny per-rank budgets with replicas (3 ranks: and a placement forced mid-generation): misses
    that another rank holds in memory come over gloo point-to-point; outputs equal the single-process
    engine, every slot fill equals the checkpoint (verify), and so do the peer-fetched bytes."""
    cfg = ParallelConfig(world, num_redundant_experts=world, peer_tier="on")
    llm = LLM(str(ep_checkpoint), expert_parallel=cfg, device_memory="20%", host_memory="30%", verify=True)
    try:
        assert any(line.startswith("peer tier: on (forced): link") for line in llm.plan_lines)
        _check_equal(llm, single)
        if world == 3:
            layers = llm.source.layers
            new = balanced_placement(torch.rand(len(layers), 16), layers, 3, 3, version=9)
            assert _generate_switching_at_step_6(llm, new) == single["tokens"][0]
            assert llm.experts.placement.version == 9
        s = llm.expert_stats()
        ep = s["expert_parallel"]
        assert ep["peer_tier"] and ep["peer_hits"] > 0
        assert ep["peer_bytes_in"] == ep["peer_bytes_out"] > 0  # every byte received was sent by a rank
        per_rank = [r["cache"]["per_tier"]["peer"]["hits"] for r in ep["ranks"]]
        assert sum(per_rank) == ep["peer_hits"] and s["per_tier"]["peer"]["hits"] == per_rank[0]
        # tiny budgets: every rank also read from its disk, whole experts (peer hits taken off)
        nbytes = llm.source.expert_nbytes
        assert all(r["cache"]["per_tier"]["disk"]["bytes_read"] > 0 for r in ep["ranks"])
        assert all(r["cache"]["per_tier"]["disk"]["bytes_read"] % nbytes == 0 for r in ep["ranks"])
        assert per_rank[0] > 0 and _slot_bytes_equal_checkpoint(llm, llm.experts.peer.received) > 0
    finally:
        llm.close()


def test_peer_hits_replace_exactly_their_disk_reads(ep_checkpoint):
    """The same generation with the peer tier off and on (no prefetch: every read is a demand miss the
    planner makes alike in both runs): per rank, the disk bytes of the peer-off run equal the disk
    bytes of the peer-on run plus one expert per peer hit."""

    def run(peer):
        cfg = ParallelConfig(2, num_redundant_experts=2, peer_tier=peer)
        llm = LLM(
            str(ep_checkpoint), expert_parallel=cfg, device_memory="20%", host_memory="30%", prefetch="off"
        )
        try:
            llm.generate(PROMPTS, GREEDY)
            ep = llm.expert_stats()["expert_parallel"]
            return (
                {r["rank"]: r["cache"]["per_tier"]["disk"]["bytes_read"] for r in ep["ranks"]},
                {r["rank"]: (r["peer"] or {}).get("hits", 0) for r in ep["ranks"]},
                llm.source.expert_nbytes,
            )
        finally:
            llm.close()

    off, off_hits, nbytes = run("off")
    on, on_hits, _ = run("on")
    assert sum(on_hits.values()) > 0 and not any(off_hits.values())
    for rank in (0, 1):
        assert off[rank] == on[rank] + on_hits[rank] * nbytes, (rank, off, on, on_hits)


def test_killed_rank_is_named_not_waited_out(ep_checkpoint):
    """The death is detected (the lost connection, the exited process), not waited out: the error names
    the rank and its exit code, which only the process watch knows (a timeout would say that a rank did
    not answer within 600 s, and this test would take ten minutes)."""
    llm = LLM(str(ep_checkpoint), expert_parallel=ParallelConfig(2, timeout_s=600))
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
        os.kill(llm.group.procs[0].pid, signal.SIGKILL)
        with pytest.raises(ExpertParallelError, match="rank 1 exited with code -9") as info:
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0))
        assert "did not answer" not in str(info.value)
    finally:
        llm.close()


def test_cli_generate_with_two_ranks(ep_checkpoint, single):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertcache.cli",
            "generate",
            str(ep_checkpoint),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--expert-parallel",
            "2",
            "--enable-eplb",
            "--eplb-step-interval",
            "2",
            "--peer-tier",
            "on",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "expert parallel 2 ranks, balance max/mean" in r.stderr and ", peer tier 0 hits" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertcache.cli",
            "generate",
            str(ep_checkpoint),
            "--prompt",
            "hi",
            "--enable-eplb",
            "--peer-tier",
            "off",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "--enable-eplb, --peer-tier: need --expert-parallel" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertcache.cli",
            "generate",
            str(ep_checkpoint),
            "--prompt",
            "hi",
            "--expert-parallel",
            "2",
            "--eplb-step-interval",
            "5",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "only applies with eplb=True (--enable-eplb)" in r.stderr


def test_torchrun_two_ranks(ep_checkpoint, single):
    """The same command under torchrun (its own rendezvous): rank 0 prints, rank 1 mirrors."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "expertcache.cli",
            "generate",
            str(ep_checkpoint),
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--expert-parallel",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "expert parallel 2 ranks" in r.stderr and "expert-parallel rank 1 ready" in r.stderr


def test_server_with_two_ranks(ep_checkpoint, tmp_path):
    pytest.importorskip("openai")
    from serving import start_server

    one = LLM(str(ep_checkpoint))  # the single-process engine: what the 2-rank server must answer
    want = one.generate("hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    want_chat = one.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))[0]
    one.close()
    with start_server(
        ep_checkpoint,
        tmp_path / "server.log",
        "--served-model-name",
        "tiny",
        "--expert-parallel",
        "2",
        "--no-access-log",
    ) as server:
        client = server.client()
        ignore = {"ignore_eos": True}
        ref = client.completions.create(
            model="tiny", prompt="hello", max_tokens=6, temperature=0, extra_body=ignore
        )
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt="hello", max_tokens=6, temperature=0, stream=True, extra_body=ignore
            )
        )
        assert ref.choices[0].text == want.text and streamed == want.text and ref.usage.completion_tokens == 6
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.content == want_chat.text
        assert chat.choices[0].finish_reason == want_chat.finish_reason
        with server.http() as http:
            ep = http.get("/stats").json()["expert_stats"]["expert_parallel"]
            assert ep["world_size"] == 2 and sum(ep["pairs_per_rank_last_step"]) > 0
            metrics = http.get("/metrics").text
            assert 'expertcache:ep_balance{window="mean"}' in metrics
            assert 'expertcache:ep_peer_hits_total{rank="1"}' in metrics
            assert 'expertcache:ep_bytes_rearranged_total{source="peer"}' in metrics


def test_an_oversized_message_fails_the_group_with_its_size(ep_checkpoint, monkeypatch):
    """A message over the wire's size cap is refused with its size named, and the group is marked failed
    (its ranks are out of step): the next step says so at once instead of hanging in a collective."""
    from expertcache.parallel import wire

    llm = LLM(str(ep_checkpoint), expert_parallel=ParallelConfig(2, timeout_s=600))
    try:
        want = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids
        assert len(want) == 2
        monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 64)
        with pytest.raises(ExpertParallelError, match=r"malformed message .* message of \d+ bytes announced"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
        with pytest.raises(ExpertParallelError, match="malformed message"):  # failed from then on
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        llm.close()
