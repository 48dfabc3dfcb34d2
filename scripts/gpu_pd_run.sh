#!/usr/bin/env bash
# Issue 15 on two GPUs in one session of at most ~280 s: the environment (.devrun/setup.sh:
# wheels, editable installs), the native build, the benchmarks (scripts/gpu_pd_bench.py), the
# NCCL check of kvcore.send/recv's fast path and refusals (scripts/gpu_p2p_check.py), the P/D
# demo over NCCL and the CUDA copy tests. Each step has its own time limit and writes into
# $OUT as it goes, so a step that hangs costs only its own results.
#   bash scripts/gpu_pd_run.sh        (repository root, with .devrun/ and .whl/ copied in)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/pd_out}
mkdir -p "$O"
T0=$(date +%s)
stamp() { echo "[gpu_pd_run +$(( $(date +%s) - T0 ))s] $*" | tee -a "$O/steps.txt"; }
stamp "setup"
source .devrun/setup.sh > "$O/setup.txt" 2>&1
export KVCORE_BUILD_DIR=$PWD/build/kvcore-native
nvidia-smi -L >> "$O/setup.txt" 2>&1
stamp "build"
timeout -k 5 150 python3 -c "from kvcore.kernels import _build; st = _build.load(); print(st)" > "$O/build.txt" 2>&1
stamp "build rc=$?"
stamp "bench"
timeout -k 5 110 python3 scripts/gpu_pd_bench.py --out "$O" --skip-tests --p2p-timeout 85 > "$O/bench_stdout.txt" 2>&1
stamp "bench rc=$?"
stamp "p2p check"
timeout -k 5 45 python3 scripts/gpu_p2p_check.py --out "$O" --timeout 40 > "$O/p2p_check.txt" 2>&1
stamp "p2p check rc=$?"
stamp "pd demo"
timeout -k 5 40 python3 -m kvcore_vllm.pd_demo --device cuda --json --timeout 35 > "$O/pd_demo_cuda.json" 2> "$O/pd_demo_err.txt"
stamp "pd demo rc=$?"
stamp "copy tests"
timeout -k 5 40 python3 -m pytest -q -x -p no:cacheprovider tests/test_copy.py -k cuda > "$O/copy_tests.txt" 2>&1
stamp "copy tests rc=$?"
tail -25 "$O/bench_stdout.txt"; tail -12 "$O/p2p_check.txt"; tail -c 600 "$O/pd_demo_cuda.json"; tail -3 "$O/copy_tests.txt"
