#!/usr/bin/env bash
# Issue 26 on ONE GPU (nvidia-h200), one session of a few minutes: the environment (wheels in
# .whl/), the native build, the GPU engine's tests over the one-GPU loopback wire
# (tests/test_distributed_gpu.py), the CUDA copy tests (last, while time is left), the
# host time per fast call eager vs CUDA graphs (scripts/gpu_p2p_graph.py) for this checkout and
# for the kvcore in $BEFORE (another checkout, optional), and the per-call Python profile
# (scripts/p2p_host_profile.py, canned mode) for both. Each step has its own time limit and
# writes into $OUT as it goes.
#   bash scripts/gpu_pd_fast_run.sh            (repository root; BEFORE=dir-with-kvcore-and-csrc optional)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
O=${OUT:-/tmp/pd_fast_out}
mkdir -p "$O"
T0=$(date +%s)
stamp() { echo "[gpu_pd_fast_run +$(( $(date +%s) - T0 ))s] $*" | tee -a "$O/steps.txt"; }
BUDGET=${BUDGET:-480}  # seconds: a step starts only while the run is inside it
left() { [ $(( $(date +%s) - T0 )) -lt "$BUDGET" ] || { stamp "skipped (past ${BUDGET}s): $*"; return 1; }; }
stamp "setup"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> "$O/steps.txt" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export KVCORE_BUILD_DIR=$PWD/build/kvcore-native
{ nvidia-smi -L; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; } >> "$O/steps.txt" 2>&1
stamp "build"
timeout -k 5 300 python3 -c "from kvcore.kernels import _build; st = _build.load(); print(st.loaded, st.cuda, st.reason)" > "$O/build.txt" 2>&1
stamp "build rc=$? $(tail -1 "$O/build.txt")"
left "gpu tests" && stamp "gpu tests" &&
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_distributed_gpu.py > "$O/tests.txt" 2>&1
stamp "gpu tests rc=$? $(tail -1 "$O/tests.txt")"
left "bench after" && stamp "bench after" &&
timeout -k 5 100 python3 scripts/gpu_p2p_graph.py --out "$O" --tag after >> "$O/steps.txt" 2>&1
stamp "bench after rc=$?"
if [ -n "${BEFORE:-}" ]; then
  left "bench before" && stamp "bench before ($BEFORE)" &&
  timeout -k 5 70 python3 scripts/gpu_p2p_graph.py --out "$O" --tag before --kvcore-root "$BEFORE" --skip-nccl >> "$O/steps.txt" 2>&1
  stamp "bench before rc=$?"
  left "profile before" && stamp "profile before" &&
  KVCORE_ROOT=$BEFORE timeout -k 5 45 python3 scripts/p2p_host_profile.py --modes canned --tokens 1,256 --calls 2000 --out "$O/prof_before" >> "$O/steps.txt" 2>&1
  stamp "profile before rc=$?"
fi
left "profile after" && stamp "profile after" &&
timeout -k 5 45 python3 scripts/p2p_host_profile.py --modes canned --tokens 1,256 --calls 2000 --out "$O/prof_after" >> "$O/steps.txt" 2>&1
stamp "profile after rc=$?"
left "copy tests" && stamp "cuda copy tests" &&
timeout -k 5 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_copy.py -k cuda >> "$O/tests.txt" 2>&1
stamp "copy tests rc=$? $(tail -1 "$O/tests.txt")"
grep -E "^ *[0-9]+ (eager|graph)|components|NCCL one-rank|kvcore from|verified|FAILED|Error" "$O/steps.txt" | tail -30
