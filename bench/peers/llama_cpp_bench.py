"""expertcache against llama.cpp on the same machine, in the same run: the yardstick checkpoint
(bench/yardstick.py) as GGUF bf16 and q8_0 for llama.cpp, as bf16 and int8 experts for expertcache,
all weights resident, 2 threads; llama-bench and expertcache alternate round by round and the
ratios come from the medians of that one run.

    python bench/peers/llama_cpp_bench.py [--cache ~/.cache/expertcache-peers] [--rounds 5] [--threads 2]
        [--formats bf16 int8] [--cpu-math exact fast] [--prompt 128] [--gen 32]

Once (kept in --cache): llama.cpp is built from the llama-cpp-python==0.3.36 source distribution
(its vendored llama.cpp, commit 0c1e570; cmake + ninja, `llama-bench` and `llama-quantize`), the
yardstick checkpoint is built, converted with llama.cpp's own convert_hf_to_gguf.py (and the gguf-py
beside it) to bf16, quantized to q8_0 with llama-quantize, and quantized to int8 experts with
`expertcache quantize` (group 128; the dense weights, lm_head included, are quantized at load).

Per round and format: `llama-bench -m M -p P -n G -r 1 -t THREADS -o json` (mmap; the weights are
warm in the page cache), then the same counts through one long-lived expertcache process (model
loaded once, prefix caching off so that every round prefills the whole prompt, as llama-bench does): a
P-token prompt's prefill and G decode steps (greedy, ignore_eos; decode timed end to end: the
generate call's wall time less the prefill's, bench/common.py timed_generate). Lines:
    peer: round=R engine=... format=... [cpu_math=...] pp_tok_s=... tg_tok_s=...
    peer-summary: format=... cpu_math=... llama_pp=... expertcache_pp=... pp_ratio=... llama_tg=... expertcache_tg=... tg_ratio=...
    peer-rounds: format=... cpu_math=... pp_ratio_median=... pp_ratio_range=... tg_ratio_median=... (per round)
    streaming: format=... cpu_math=... bytes_per_token_GB=... effective_GBps=... read_GBps=... (median of one read per round)
--cpu-math names expertcache's CPU maths to run (one process each, alternating with llama-bench in
every round): exact (float32 activations, the default) and fast (activations rounded to bf16 /
quantized to int8 as llama.cpp does; AVX-512 BF16/VNNI).
Not part of CI: it needs cmake, a C++ compiler, ~15 minutes of build and ~12 GB of disk, and the
converter's Python packages (`pip install -e ".[peers]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SDIST = "llama-cpp-python==0.3.36"
PEER_FORMAT = {
    "bf16": "bf16",
    "int8": "q8_0",
}  # expertcache format -> the llama.cpp format it is compared with
# q8_0 quantizes every matrix, lm_head and attention included: the int8 row quantizes them at load too
# (`--lm-head int8 --dense int8`, group 128)
OPTIONS = {"bf16": {}, "int8": {"lm_head": "int8", "dense": "int8"}}


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_llama_cpp(cache: Path) -> Path:
    """-> the directory of llama-bench / llama-quantize (built once)."""
    bench = cache / "build" / "bin" / "llama-bench"
    src = cache / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    if bench.exists() and (cache / "build" / "bin" / "llama-quantize").exists():
        return bench.parent
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / "llama_cpp_python-0.3.36.tar.gz"
    if not tarball.exists():
        sh(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                str(cache),
            ]
        )
    if not src.exists():
        sh(["tar", "xzf", str(tarball), "-C", str(cache)])
    sh(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(cache / "build"),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_BUILD_UI=OFF",
        ]
    )
    sh(["cmake", "--build", str(cache / "build"), "-j2", "--target", "llama-bench", "llama-quantize"])
    return bench.parent


def models(cache: Path, bindir: Path, tokenizer: Path) -> dict[str, tuple[Path, Path]]:
    """format -> (expertcache checkpoint dir, llama.cpp GGUF file), built once. The converter
    identifies a tokenizer by its pre-tokenizer and does not know the demo's tiny trained one, so
    the GGUF gets the real Qwen3 tokenizer (`tokenizer`; the weights are the same files, and
    llama-bench feeds token ids, so this changes no timing)."""
    from yardstick import SIZES

    from expertcache.demo import build_demo_model
    from expertcache.quantize.rewrite import quantize_checkpoint

    yard = cache / "yardstick"
    if not (yard / "config.json").exists():
        build_demo_model(yard, progress=True, **SIZES)
    conv = cache / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    bf16 = cache / "yardstick-bf16.gguf"
    if not bf16.exists():
        src = cache / "yardstick-gguf-src"
        src.mkdir(exist_ok=True)
        for f in yard.iterdir():
            if not f.name.startswith("tokenizer") and not (src / f.name).exists():
                (src / f.name).symlink_to(f)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (src / f).write_bytes((tokenizer / f).read_bytes())
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        sh(
            [sys.executable, str(conv), str(src), "--outtype", "bf16", "--outfile", str(bf16) + ".tmp"],
            env=env,
        )
        os.replace(str(bf16) + ".tmp", bf16)
    q8 = cache / "yardstick-q8_0.gguf"
    if not q8.exists():
        sh([str(bindir / "llama-quantize"), str(bf16), str(q8) + ".tmp", "Q8_0", "2"])
        os.replace(str(q8) + ".tmp", q8)
    int8 = cache / "yardstick-int8"
    if not (int8 / "config.json").exists():
        quantize_checkpoint(yard, int8, "int8", group_size=128)
    return {"bf16": (yard, bf16), "int8": (int8, q8)}


def llama_bench_rows(
    bindir: Path, gguf: Path, prompts: str, gen: int, threads: int, extra: tuple = (), prefix: tuple = ()
) -> list[dict]:
    """One `llama-bench -r 1 -o json` run (`prompts`: llama-bench's -p list, e.g. "128,512"; `extra`:
    further llama-bench flags; `prefix`: a command prefix, e.g. a memory cgroup) -> its JSON rows."""
    out = subprocess.run(
        [
            *prefix,
            str(bindir / "llama-bench"),
            "-m",
            str(gguf),
            "-p",
            prompts,
            "-n",
            str(gen),
            "-r",
            "1",
            "-t",
            str(threads),
            "-o",
            "json",
            *extra,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def llama_bench(bindir: Path, gguf: Path, prompt: int, gen: int, threads: int) -> tuple[float, float]:
    rows = llama_bench_rows(bindir, gguf, str(prompt), gen, threads)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0)
    return pp, tg


WORKER = r"""
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from common import memory_pages, timed_generate
from expertcache import LLM, SamplingParams
torch.set_num_threads({threads})
# every round prefills the whole prompt
# (options override the defaults: a 48-layer model needs more than 64 MiB of KV cache for 512 tokens)
llm = LLM({model!r}, **{{"max_model_len": max(512, {prompt} + {gen} + 8), "kv_cache_memory": "64MiB",
          "prefix_caching": False, **{options!r}}})
prompt = torch.randint(3, 2000, ({prompt},), generator=torch.Generator().manual_seed(0)).tolist()
for n in {warm!r}:  # warm-up: every prompt length once (a prefill path measures its crossovers at first use)
    llm.generate([prompt[:n]], SamplingParams(max_tokens=2, temperature=0.0))
m, src = llm.model, llm.source
size = lambda t: t.nbytes if hasattr(t, "parts") else t.numel() * t.element_size()
dense = sum(size(t) for layer in m.layers for t in layer["attn"].w.values())
dense += sum(layer["router"].numel() * layer["router"].element_size() for layer in m.layers if "router" in layer)
head = size(m.lm_head)
per_token = src.expert_nbytes * src.cfg.top_k * len(src.layers) + dense + head
resident = type(llm.experts).__name__ == "ResidentExperts"  # every expert held in RAM, none cached
pages = memory_pages()
huge = pages["anon_huge_GB"] / max(pages["anon_GB"], 1e-9)  # the share of anonymous memory on 2 MiB pages
print("READY " + json.dumps({{"bytes_per_token": per_token, "cpu_math": llm.config.kernels.cpu_math,
                             "experts_resident": resident, "huge_pages": huge}}), flush=True)
for line in sys.stdin:  # "go [PROMPT GEN]": a shorter prompt / fewer tokens than the worker was made for
    words = line.split()
    n, gen = (int(words[1]), int(words[2])) if len(words) == 3 else ({prompt}, {gen})
    r = timed_generate(llm, [prompt[:n]], SamplingParams(max_tokens=gen + 1, temperature=0.0, ignore_eos=True))
    s = llm.expert_stats() or {{}}
    disk = s.get("per_tier", {{}}).get("disk", {{}}).get("bytes_read", 0)
    print("RESULT " + json.dumps({{"pp": r["prefill_tok_s"], "tg": r["decode_tok_s"], "disk_bytes": disk}}), flush=True)
"""


class Worker:
    """One expertcache process holding the model; `run()` measures one round."""

    def __init__(
        self,
        model: Path,
        prompt: int,
        gen: int,
        threads: int,
        options: dict,
        prefix: tuple = (),
        warm: tuple = (),
    ):
        """warm: prompt lengths run once before READY (besides 8 tokens and the whole prompt)."""
        code = WORKER.format(
            bench=str(HERE.parent),
            threads=threads,
            model=str(model),
            prompt=prompt,
            gen=gen,
            options=options,
            warm=tuple(sorted({8, prompt, *warm})),
        )
        self.p = subprocess.Popen(
            [*prefix, sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )
        self.info = json.loads(self._expect("READY "))

    def _expect(self, tag: str) -> str:
        for line in self.p.stdout:
            if line.startswith(tag):
                return line[len(tag) :]
        raise RuntimeError(f"expertcache worker exited with {self.p.wait()}")

    def run(self) -> tuple[float, float]:
        r = self.measure()
        return r["pp"], r["tg"]

    def measure(self, prompt: int | None = None, gen: int | None = None) -> dict:
        """One generate call (the worker's prompt and token count unless given) -> {pp, tg, disk_bytes}
        (disk_bytes: the engine's disk-tier bytes read so far, cumulative)."""
        self.p.stdin.write("go\n" if prompt is None else f"go {prompt} {gen}\n")
        self.p.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "expertcache-peers")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8"], choices=sorted(PEER_FORMAT))
    ap.add_argument("--cpu-math", nargs="+", default=["exact"], choices=["exact", "fast"])
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=HERE.parents[2] / "shared" / "tokenizers" / "qwen3",
        help="a Qwen3 tokenizer.json + tokenizer_config.json for the GGUF (default: ../shared/tokenizers/qwen3)",
    )
    args = ap.parse_args()
    import torch
    from common import hardware_line
    from kernel_bench import read_bandwidth

    torch.set_num_threads(args.threads)
    print(hardware_line(), flush=True)
    bindir = build_llama_cpp(args.cache)
    ver = subprocess.run([str(bindir / "llama-bench"), "--version"], capture_output=True, text=True)
    print(
        f"llama.cpp: {(ver.stdout + ver.stderr).strip().splitlines()[-1] if (ver.stdout + ver.stderr).strip() else '?'}"
    )
    paths = models(args.cache, bindir, args.tokenizer)
    bw = read_bandwidth()
    print(f"memory: read_GBps={bw:.1f} (256 MiB float32 sum, {args.threads} threads)", flush=True)
    for fmt in args.formats:
        model, gguf = paths[fmt]
        peer = PEER_FORMAT[fmt]
        workers = {
            m: Worker(model, args.prompt, args.gen, args.threads, {**OPTIONS[fmt], "cpu_math": m})
            for m in args.cpu_math
        }
        res = {"llama.cpp": [], **{m: [] for m in workers}}
        bws = []
        try:
            for r in range(args.rounds):
                bws.append(read_bandwidth())  # per round: the limit moves with the machine's load
                for engine in res:
                    t0 = time.perf_counter()
                    pp, tg = (
                        llama_bench(bindir, gguf, args.prompt, args.gen, args.threads)
                        if engine == "llama.cpp"
                        else workers[engine].run()
                    )
                    res[engine].append((pp, tg))
                    what = (
                        f"llama.cpp format={peer}"
                        if engine == "llama.cpp"
                        else f"expertcache format={fmt} cpu_math={engine}"
                    )
                    print(
                        f"peer: round={r} engine={what} pp{args.prompt}_tok_s={pp:.1f} tg{args.gen}_tok_s={tg:.2f} "
                        f"wall_s={time.perf_counter() - t0:.0f}",
                        flush=True,
                    )
        finally:
            for w in workers.values():
                w.close()
        lp, lt = (
            statistics.median(p for p, _ in res["llama.cpp"]),
            statistics.median(t for _, t in res["llama.cpp"]),
        )
        for m, w in workers.items():
            ep, et = statistics.median(p for p, _ in res[m]), statistics.median(t for _, t in res[m])
            print(
                f"peer-summary: format={fmt} cpu_math={m} options={OPTIONS[fmt]} vs llama.cpp {peer} rounds={args.rounds} "
                f"threads={args.threads} llama_pp={lp:.1f} expertcache_pp={ep:.1f} pp_ratio={ep / lp:.2f} "
                f"llama_tg={lt:.2f} expertcache_tg={et:.2f} tg_ratio={et / lt:.2f}",
                flush=True,
            )
            # the machine's speed drifts between rounds (both engines together): the ratio within each round
            # (llama-bench then expertcache, back to back) is the steadier comparison
            rounds = list(zip(res["llama.cpp"], res[m]))
            rp = sorted(e[0] / l[0] for l, e in rounds)
            rt = sorted(e[1] / l[1] for l, e in rounds)
            print(
                f"peer-rounds: format={fmt} cpu_math={m} pp_ratio_median={statistics.median(rp):.2f} "
                f"pp_ratio_range={rp[0]:.2f}-{rp[-1]:.2f} tg_ratio_median={statistics.median(rt):.2f} "
                f"tg_ratio_range={rt[0]:.2f}-{rt[-1]:.2f}",
                flush=True,
            )
            gb, bw = w.info["bytes_per_token"] / 1e9, statistics.median(bws)
            print(
                f"streaming: format={fmt} cpu_math={m} bytes_per_token_GB={gb:.3f} (top-k experts + attention + "
                f"routers + lm_head) effective_GBps={gb * et:.1f} read_GBps={bw:.1f} share={gb * et / bw:.0%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
