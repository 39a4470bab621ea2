#!/usr/bin/env bash
# The device check in one command, for a machine with a CUDA GPU: from the repository root, nothing to
# install, no network. Only a summary goes to the results folder ($OUT, else /tmp/gpu_check/results):
#   probe.txt        the machine: python/torch/triton/numpy versions, GPU, compilers, memory, disks, ulimit -l
#   summary.txt      every `gpu_check` line (tests, configurations, ratios), written as they come
#   child-logs.txt   the last 4000 characters of every log (pytest runs, each configuration, the background jobs)
#   junit-gpu-marked.xml, junit-triton-compiled.xml   the pytest results, failures with their tracebacks
#   this-cpu.json    the cost profile the engine measured on this machine (link, GPU bandwidth, TFLOP/s)
# Everything else (the 8 GB checkpoint, the full logs) stays in the work folder /tmp/gpu_check.
# Phases: probe (~10 s); the C++ CPU kernels and the checkpoint written in the background (CPU only)
# while the gpu-marked tests and the compiled Triton tests run (<= 150 s each); then the configurations
# resident, default, sync-lru, cpu-moe (recorded routing first), cut by a deadline so the whole command
# ends within BUDGET seconds (default 560; a lent machine allows 600 per command).
#   bash bench/device_run.sh                 # the full check
#   QUICK=1 bash bench/device_run.sh         # 6 layers, 16 tokens, recorded routing, test_gpu.py only
#   CONFIGS="default cpu-compute-off torch-moe" SKIP_TESTS=1 bash bench/device_run.sh   # a follow-up
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
BUDGET=${BUDGET:-560}
PY=${PYTHON:-python3}
R=${OUT:-/tmp/gpu_check/results}
G=${WORK:-/tmp/gpu_check}  # the work folder: checkpoint, trace, full logs
CONFIGS=${CONFIGS:-resident default sync-lru cpu-moe}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: the dry run at toy sizes (no checkpoint written in the background)
mkdir -p "$R" "$G/logs"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/xdg}
LAYERS=12; QUICK_FLAG=""
if [ -n "$QUICK" ]; then LAYERS=6; QUICK_FLAG="--quick"; fi

{ date -u; nvidia-smi
  $PY -c "import sys,torch,triton,numpy as n;print(sys.version,torch.__version__,triton.__version__,n.__version__,torch.cuda.get_device_name(0),torch.cuda.get_device_capability(0),torch.cuda.mem_get_info())"
  command -v g++ c++ nvcc ninja; g++ --version | head -1; nproc; free -g; df -h /tmp /dev/shm "$R"; ulimit -l
  mount | grep -E ' /tmp | / '; cat /sys/kernel/mm/transparent_hugepage/enabled
  $PY -m pip list 2>/dev/null | grep -iE '^(pytest|pytest-timeout|pytest-xdist|transformers|safetensors|tokenizers) '
} >"$R/probe.txt" 2>&1

# CPU-only work in the background (nothing else touches the GPU while a configuration's plan is measured)
(time $PY -m expertcache.kernels) >"$G/logs/bg-kernels.log" 2>&1 &
[ "$DEVICE" = cpu ] || (time $PY -c "import sys;sys.path[:0]=['bench','.'];import gpu_check_model as M;from pathlib import Path;\
s=dict(M.BENCH,num_hidden_layers=$LAYERS);M.write_checkpoint(Path('$G/ckpt-$LAYERS'),s)") >"$G/logs/bg-checkpoint.log" 2>&1 &

if [ -z "$SKIP_TESTS" ]; then
  $PY bench/gpu_check.py --tests-only --device "$DEVICE" $QUICK_FLAG --out "$G" --results "$R" --test-timeout 150 2>&1 | tee -a "$G/run.log"
fi
wait
LEFT=$((BUDGET - SECONDS - 15))
# shellcheck disable=SC2086  # CONFIGS is a list of words
$PY bench/gpu_check.py --skip-tests --device "$DEVICE" $QUICK_FLAG --out "$G" --results "$R" --config-timeout 90 --deadline "$LEFT" \
  --only $CONFIGS 2>&1 | tee -a "$G/run.log"
cp "$XDG_CACHE_HOME/expertcache/this-cpu.json" "$R/" 2>/dev/null
nvidia-smi --query-gpu=memory.used,clocks.sm,temperature.gpu --format=csv >>"$R/probe.txt" 2>&1
echo "device_run: ${SECONDS}s; results in $R: $(ls "$R" | tr '\n' ' ')"
