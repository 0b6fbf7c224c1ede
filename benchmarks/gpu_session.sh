#!/usr/bin/env bash
# Everything a session with a lent GPU checks and measures, one stage per device call (a call may
# run 10 minutes; the session has 30). Run from the repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh check     # kernel and fusion tests on CUDA (~2 min)
#   bash benchmarks/gpu_session.sh kernels   # benchmarks/kernels.py, bf16, appends to RESULTS.md
#   bash benchmarks/gpu_session.sh mfu       # benchmarks/mfu.py, 1.3B GPT, appends to RESULTS.md
#   bash benchmarks/gpu_session.sh suite     # the CPU test suite's fast part under the machine's torch
#   bash benchmarks/gpu_session.sh all       # check, kernels, mfu in one call (may run near 10 minutes)
#
# Logs and the appended RESULTS.md land in $OUT (the device tool brings that folder back), else
# ./gpu_out. The machine's image has torch, CuPy, pytest, tabulate and sympy but no registry, so
# autoshard is installed without dependencies; its torch is not the pinned one (2.11 was seen).
set -uo pipefail
stage=${1:?usage: gpu_session.sh check|kernels|mfu|suite|all}
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

$py -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
$py -c "import torch, cupy; print('torch', torch.__version__, '| cupy', cupy.__version__, '|', torch.cuda.get_device_name())" \
  | tee -a "$out/gpu.txt" || exit 1

run_stage() {
  case $1 in
    check)   $py -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_fuse.py tests/test_dropout_rng.py 2>&1 | tee "$out/check.log" ;;
    kernels) $py benchmarks/kernels.py --append 2>&1 | tee "$out/kernels.log" ;;
    mfu)     $py benchmarks/mfu.py --append 2>&1 | tee "$out/mfu.log" ;;
    suite)   $py -m pytest -q -x -m "not slow" -p no:cacheprovider -n 8 2>&1 | tee "$out/suite.log" ;;
    *)       echo "unknown stage $1" >&2; return 2 ;;
  esac
}
rc=0
if [ "$stage" = all ]; then
  for s in check kernels mfu; do run_stage $s || rc=$?; done
else
  run_stage "$stage" || rc=$?
fi
cp benchmarks/RESULTS.md "$out/RESULTS.md"
exit $rc
