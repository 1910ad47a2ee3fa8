#!/usr/bin/env bash
# Every GPU test and the GPU benchmark in one go, on a GPU machine without network access: the
# machine's own Python and torch (CUDA), weightsync from this tree, its dependencies, test tools
# and uccl's pinned wheel from the wheels `make gpu-wheels` put in .gpu/wheels; then the tests
# and the bench.
# Logs, JUnit XML and the bench's output go to $OUT (default .gpu/out).
#
#   bash tests/gpu/run.sh [all|tests|bench]    # from the repository root (default all)
#
# tests and bench run apart where one call may not last long enough for both. The whole run keeps
# within RUN_BUDGET seconds (default 470, under 8 minutes): each step's bound is cut to what the
# steps after it leave.
set -uo pipefail
WHAT=${1:-all}
START=$(date +%s)
BUDGET=${RUN_BUDGET:-470}
# bound WANT SECONDS cut so that KEEP seconds stay for the steps after it (10 at least)
bound() { local want=$1 left=$(( START + BUDGET - $(date +%s) - $2 )); [ "$left" -lt "$want" ] && want=$left; [ "$want" -lt 10 ] && want=10; echo "$want"; }
UCCL_DEADLINE=${UCCL_DEADLINE:-60}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
after_tests=0; [ "$WHAT" = all ] && after_tests=$BENCH_TIMEOUT
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/run-$WHAT.log") 2>&1

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "the machine"
nvidia-smi || true
$PY -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())'

step "environment"
# torch and numpy stay the machine's; everything else comes from the carried wheels, unpacked
# once into .gpu/site, and weightsync runs from the source tree
V=$PY
export PYTHONPATH="$PWD/worker:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
if [ ! -d .gpu/site ]; then
  $V -m pip install -q --no-index --no-deps --target .gpu/site $(ls .gpu/wheels/*.whl | grep -v nvidia_cuda_runtime) \
    || { echo "installing .gpu/wheels failed: run make gpu-wheels where there is network"; exit 2; }
  # CUDA 12's runtime apart from the Python path, where torch (built for CUDA 13) never looks for it
  $V -c 'import glob, zipfile; zipfile.ZipFile(glob.glob(".gpu/wheels/nvidia_cuda_runtime_cu12-*.whl")[0]).extractall(".gpu/cuda12")'
  rm -rf .gpu/site/setuptools .gpu/site/pkg_resources .gpu/site/_distutils_hack .gpu/site/wheel
fi
# uccl 0.1.1's engine links CUDA 12's runtime, which a CUDA 13 image lacks: the carried one
export LD_LIBRARY_PATH="$PWD/.gpu/cuda12/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
$V -c 'import weightsync, transformers, xxhash, pytest, torch; print("weightsync from", weightsync.__file__)'
# the host cast's C extension, built for this Python where it has a compiler and headers; Triton
# builds its kernels' launcher with the same compiler (ws64 on the GPU is a Triton kernel)
command -v gcc >/dev/null || command -v clang >/dev/null \
  || echo "no C compiler here: Triton cannot build its launcher, so ws64 on the GPU (and every test that moves GPU bytes) will fail"
$V setup.py -q build_ext --inplace 2>&1 | tail -3
$V -c 'from weightsync.model.flat import cast_name; print("host float32 -> bfloat16 cast:", cast_name())'

step "uccl: what loads"
for mode in rdma tcp; do
UCCL_P2P_TRANSPORT=${mode/rdma/} timeout 30 $V - <<'PY' 2>&1 | tee -a "$OUT/uccl.txt"
import os
from weightsync.transport import uccl
reason = uccl.unavailable_reason()
print(os.environ.get("UCCL_P2P_TRANSPORT") or "rdma", "mode, unavailable_reason:", reason)
if reason is None:
    from uccl import p2p
    ep = p2p.Endpoint(0)
    print("endpoint metadata:", p2p.Endpoint.parse_metadata(bytes(ep.get_metadata())))
PY
done

tests=0
if [ "$WHAT" != bench ]; then
step "GPU tests"
# GPU_TESTS: some of the files, where one call may not last long enough for all of them
GPU_TESTS=${GPU_TESTS:-tests/worker/transport/test_checksum.py tests/worker/model/test_flat.py \
  tests/worker/transport/test_transport_p2p.py tests/worker/transport/test_transports_gpu.py tests/worker/local/test_runner_gpu.py}
# every test named in the log as it ends; at TESTS_DEADLINE pytest is interrupted (SIGINT), so that
# it still writes the JUnit XML of what ran; pytest-xdist, where the machine has it, runs
# GPU_WORKERS tests at a time (they share the one GPU)
parallel=$($V -c 'import xdist' 2>/dev/null && echo "-n ${GPU_WORKERS:-4}")
timeout -s INT -k 15 "$(bound "${TESTS_DEADLINE:-210}" $(( UCCL_DEADLINE + after_tests + 20 )))" $V -m pytest -v -ra -m gpu -p no:cacheprovider $parallel \
  --timeout "${TEST_TIMEOUT:-120}" --junitxml "$OUT/gpu-tests.xml" $GPU_TESTS 2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}

step "uccl in its TCP mode (over NCCL, which it loads itself)"
export UCCL_NCCL_SO=$($V -c 'import glob, site; print((glob.glob(site.getsitepackages()[0] + "/nvidia/nccl/lib/libnccl.so*") or [""])[0])')
echo "UCCL_NCCL_SO=$UCCL_NCCL_SO"
UCCL_P2P_TRANSPORT=tcp timeout -s INT -k 10 "$(bound "$UCCL_DEADLINE" $(( after_tests + 10 )))" $V -m pytest -v -ra -m gpu -p no:cacheprovider \
  --timeout "${TEST_TIMEOUT:-120}" \
  tests/worker/transport/test_transports_gpu.py -k uccl 2>&1 | tee "$OUT/uccl-tcp.log"
fi

if [ "$WHAT" != tests ]; then
step "GPU benchmark"
# one run, so that every ratio has its baseline from the same processes: nccl 2x2 and 1x1 each
# against a broadcast, 2x2 against 1x1, ipc against a device-to-device copy, the fused cast and
# checksum and ws64 alone against a device copy
timeout "$(bound "$BENCH_TIMEOUT" 5)" $V -m weightsync.cli bench --gpu --mb "${BENCH_MB:-512}" --shape 2x2,1x1 --reps 5 2>&1 \
  | tee "$OUT/bench-gpu.txt"
fi

step "done in $(( $(date +%s) - START )) s: GPU tests exited $tests; logs in $OUT"
exit "$tests"
