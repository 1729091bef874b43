#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, after benchmarks/device/prepare.sh here; one call of the
# device tool, e.g.  run(command="bash benchmarks/device/run.sh", carry=[".whl", ".device-data"], timeout_s=540)
# It installs the carried wheels, runs the GPU tests (tests/test_cuda.py, the robust rules on CUDA) and
# bench_backends.py --device cuda (every workload but Flower), writing logs and the benchmark's CSVs under $OUT.
# DEVICE=cpu BENCH_ARGS="--models mlp-64-32 --clients 10" runs the same steps on a CPU: a dry run of this script.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
BENCH_ARGS=${BENCH_ARGS:-}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg FEDLAB_NB_DATA="$PWD/.device-data"
step() { echo "== $* ($(date -u +%T))"; }

step "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedlab-site \
    .whl/*.whl || { echo "no wheels: run benchmarks/device/prepare.sh here and carry .whl"; exit 2; }
export PYTHONPATH="/tmp/fedlab-site:$PWD"
python3 -c "import torch, fedlab_nb; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" || exit 3
if [ "$DEVICE" != cpu ] && ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "DEVICE=$DEVICE but torch sees no GPU"; exit 4
fi

step "GPU tests on $DEVICE"
FEDLAB_TEST_DEVICE=$DEVICE timeout 150 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/test_cuda.py tests/test_robust_rules.py -k cuda 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

step "bench_backends.py --device $DEVICE"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout 330 python3 benchmarks/bench_backends.py --device "$DEVICE" --flower-models none --out "$OUT/bench" \
    $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}

step "done: tests rc $tests, benchmark rc $bench"
exit $(( tests || bench ))
