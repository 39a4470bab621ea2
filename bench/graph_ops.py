"""What `--cuda-graphs` takes off the launching thread: aten dispatches of a decode step, eager vs inside the
dense segments a replay launches as one graph each (engine/cuda_graphs.py).

    python bench/graph_ops.py [--batch 1 4] [--tokens 4]

The shipped demo model on the CPU through the engine's torch code (EXPERTCACHE_KERNELS=torch: what CUDA
runs), greedy decode; each decode step runs eagerly (eager_ops: every aten op the main thread dispatches,
MoE included) and then through DecodeGraphs with its segments called on the static buffers (graph_step_ops:
the whole step, of which segment_ops inside the segments). On a GPU a replay launches each segment as one
graph, so the launching thread is left with graph_step_ops - segment_ops dispatches (the MoE ops, the
static buffers' copy) plus graph_launches. A count, not a time: deterministic. One line per batch size:

    graph_ops batch=B moe_layers=M eager_ops=... graph_step_ops=... segment_ops=... graph_launches=M+1 left_ops=...
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("EXPERTCACHE_KERNELS", "torch")  # before the package loads its kernels

import torch  # noqa: E402
from common import hardware_line  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from expertcache import LLM, SamplingParams  # noqa: E402
from expertcache.engine.cuda_graphs import DecodeGraphs  # noqa: E402


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def run(llm: LLM, batch: int, tokens: int) -> str:
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv, max(batch, 1), capture=False)
    segment, eager = graphs.segment, runner.run_rows
    eager_ops, segment_ops, step_ops = [], [], []

    def counted_segment(k, st, prev):
        with Count() as c:
            out = segment(k, st, prev)
        segment_ops[-1] += c.n
        return out

    def both(work, full):
        if not graphs.takes(work) or any(full):
            return eager(work, full)
        with Count() as c:
            out = eager(work, full)
        eager_ops.append(c.n)
        segment_ops.append(0)
        with Count() as c:
            graphs.run(work)
        step_ops.append(c.n)
        return out

    graphs.segment, runner.run_rows = counted_segment, both
    prompts = [[3 + b, 4, 5, 6, 7 + b] for b in range(batch)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    finally:
        runner.run_rows = eager
    e, g, s, m = max(eager_ops), max(step_ops), max(segment_ops), len(graphs.moe)
    return (
        f"graph_ops batch={batch} moe_layers={m} eager_ops={e} graph_step_ops={g} segment_ops={s} "
        f"graph_launches={m + 1} left_ops={g - s} steps={len(eager_ops)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    print(hardware_line())
    llm = LLM(device="cpu", max_num_seqs=max(args.batch))
    try:
        for b in args.batch:
            print(run(llm, b, args.tokens), flush=True)
    finally:
        llm.close()


if __name__ == "__main__":
    main()
