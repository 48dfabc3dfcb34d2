#!/usr/bin/env bash
# Issue 26 on ONE GPU (nvidia-h200), one device call of a few minutes: the environment (wheels in
# .whl/), the native build, the GPU engine's tests over the one-GPU loopback wire
# (tests/test_distributed_gpu.py: eager and CUDA-graph fast paths, a NCCL group captured in a
# graph), the host time per fast call and the loopback throughput against the same run's
# NCCL-free ceilings (scripts/gpu_p2p_graph.py: one group per call eager, and KVCORE_P2P_GRAPH=1)
# for this checkout and, eager only, for the kvcore in $BEFORE (default .before/: the code
# before issue 26, two groups per one-chunk call), then the GPU engine's emulated checks and
# the CUDA copy tests while time is left. Each step has its own time limit and writes into
# $OUT as it goes (at most 7 files).
#   bash scripts/gpu_pd_fast_run.sh            (repository root; BEFORE=dir-with-kvcore-and-csrc optional,
#                                               MORE=0 leaves out the emulated engine and CUDA copy tests)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/pd_fast_out}
mkdir -p "$O"
T0=$(date +%s)
stamp() { echo "[gpu_pd_fast_run +$(( $(date +%s) - T0 ))s] $*" | tee -a "$O/steps.txt"; }
BUDGET=${BUDGET:-330}  # seconds: a step starts only while the run is inside it
left() { [ $(( $(date +%s) - T0 )) -lt "$BUDGET" ] || { stamp "skipped (past ${BUDGET}s): $*"; return 1; }; }
BEFORE=${BEFORE:-}
[ -z "$BEFORE" ] && [ -d .before/kvcore ] && BEFORE=$PWD/.before
stamp "setup"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> "$O/steps.txt" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export KVCORE_BUILD_DIR=$PWD/build/kvcore-native
{ nvidia-smi -L; nproc; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; } >> "$O/steps.txt" 2>&1
stamp "build"
timeout -k 5 240 python3 -c "from kvcore.kernels import _build; st = _build.load(); print(st.loaded, st.cuda, st.reason)" > "$O/build.txt" 2>&1
stamp "build rc=$? $(tail -1 "$O/build.txt")"
left "gpu tests" && stamp "gpu tests" &&
timeout -k 5 150 python3 -m pytest -q -rA -p no:cacheprovider tests/test_distributed_gpu.py > "$O/tests_gpu.txt" 2>&1
stamp "gpu tests rc=$? $(tail -1 "$O/tests_gpu.txt")"
left "bench after" && stamp "bench after" &&
timeout -k 5 150 python3 scripts/gpu_p2p_graph.py --out "$O" --tag after --modes eager,graph,eager >> "$O/bench.txt" 2>&1
stamp "bench after rc=$?"
if [ -n "$BEFORE" ]; then
  left "bench before" && stamp "bench before ($BEFORE)" &&
  timeout -k 5 90 python3 scripts/gpu_p2p_graph.py --out "$O" --tag before --kvcore-root "$BEFORE" --skip-nccl --modes eager >> "$O/bench.txt" 2>&1
  stamp "bench before rc=$?"
fi
[ "${MORE:-1}" = 1 ] && left "more tests" && stamp "emulated engine + cuda copy tests" &&
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/test_distributed_fast.py > "$O/tests_more.txt" 2>&1
stamp "emulated engine tests rc=$? $(tail -1 "$O/tests_more.txt")"
[ "${MORE:-1}" = 1 ] && left "cuda copy tests" && timeout -k 5 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_copy.py -k cuda >> "$O/tests_more.txt" 2>&1
stamp "cuda copy tests rc=$? $(tail -1 "$O/tests_more.txt")"
grep -E "passed|failed|error" "$O/tests_gpu.txt" | tail -3
grep -E "^ *[0-9]+ (eager|graph)|ceilings|components|NCCL one-rank|kvcore from|verified|FAILED|Error" "$O/bench.txt" | tail -24
