#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, after benchmarks/device/prepare.sh here (its wheels include
# pfl 0.6.0): issue "speed against pfl-research", item 5 — the same comparison as on the CPU, both sides on the GPU
# (pfl's PFL_PYTORCH_DEVICE=cuda, one process; ours one process). One call of the device tool, e.g.
#   run(command="bash benchmarks/device/pfl.sh", carry=[".whl", ".device-data"], timeout_s=560)
# It installs the carried wheels, checks that torch sees the GPU and pfl imports, runs the tiny CUDA comparison test
# (tests/test_bench_pfl.py: same rows, same weights up to rounding) and then bench_pfl.py --device cuda on the
# 100- and 1,000-client workloads and pfl's headline one, writing the log and CSVs under $OUT.
# DEVICE=cpu PYTHON=.venv/bin/python FEDLAB_PFL_PYTHON=.venv-pfl/bin/python BENCH_ARGS="--tiny" is a dry run here.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
BENCH_ARGS=${BENCH_ARGS:---clients 100,1000}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg FEDLAB_NB_DATA="$PWD/.device-data"
[ -d .device-data ] || unset FEDLAB_NB_DATA
step() { echo "== $* ($(date -u +%T), ${SECONDS}s)"; }

step "install the carried wheels"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedlab-site \
        .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/fedlab-site:$PWD"
elif [ "$DEVICE" = cpu ]; then
    export PYTHONPATH="$PWD"
else
    echo "no wheels: run benchmarks/device/prepare.sh here and carry .whl"; exit 2
fi
export FEDLAB_PFL_PYTHON=${FEDLAB_PFL_PYTHON:-$(command -v "$PYTHON")}   # the same interpreter holds pfl there
"$PYTHON" -c "import torch, fedlab_nb; print('torch', torch.__version__, '|', torch.cuda.get_device_name()
      if torch.cuda.is_available() else 'no GPU')" || exit 3
"$FEDLAB_PFL_PYTHON" -c "from pfl.model.pytorch import PyTorchModel; from importlib.metadata import version;
print('pfl', version('pfl'))" || { echo "pfl does not import: are its wheels in .whl?"; exit 3; }
if [ "$DEVICE" != cpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "DEVICE=$DEVICE but torch sees no GPU"; exit 4
fi

step "the tiny comparison on $DEVICE (same rows, same weights)"
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_bench_pfl.py -k "cuda or tiny" \
    2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

step "bench_pfl.py --device $DEVICE $BENCH_ARGS"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout 380 "$PYTHON" benchmarks/bench_pfl.py --device "$DEVICE" --flower-models none --out "$OUT/bench" \
    $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
step "done: tests rc $tests, benchmark rc $bench"
exit $(( tests || bench ))
