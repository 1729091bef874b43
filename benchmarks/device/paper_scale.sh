#!/usr/bin/env bash
# Run ON THE GPU MACHINE, from the repository root, after benchmarks/device/prepare.sh here; one call of the
# device tool, e.g.  run(command="bash benchmarks/device/paper_scale.sh", carry=[".whl", ".device-data"],
# timeout_s=600). It installs the carried wheels (as run.sh does), runs the CUDA equivalence tests first
# (tests/test_cuda.py and the robust rules on CUDA; if they fail, or pass nothing, it stops: no result from an
# unverified device path), then the paper scales of benchmarks/device/paper_scale_order.txt in order,
#   python -m fedlab_nb.cli reproduce ID --scale SCALE --device cuda -j 1 --results $OUT/ps
# each under `timeout BUDGET`, skipping (and saying so) an entry whose budget no longer fits the call's TOTAL
# seconds. $OUT/summary.txt: id, scale, rc, wall seconds, verdict, one line per entry.
# Storing happens on the CPU machine afterwards (benchmarks/README.md, "Paper scales on a GPU"): only a `paper`
# scale can be stored (scripts/paper_scale.py store reads ID-paper.json); a paper-substitute result never is.
#
# DEVICE=cpu is the dry run (no GPU): the same steps on the CPU; each entry runs with `-p quick True` through
# `fedlab-nb run` where its notebook has `quick`, otherwise at scale smoke (DRY_SCALE), only the first DRY_ENTRIES
# entries, with DRY_BUDGET seconds each. PYTHON names the interpreter; without .whl the dry run uses its packages.
#   DEVICE=cpu OUT=/tmp/gpu41 PYTHON=.venv/bin/python bash benchmarks/device/paper_scale.sh
set -uo pipefail
START=$SECONDS
OUT=${OUT:-$(mktemp -d)}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
TOTAL=${TOTAL:-570}                 # seconds this script may use (the device call allows 600)
MARGIN=${MARGIN:-15}                # seconds kept back after the last run (copying $OUT back)
ORDER=${ORDER:-benchmarks/device/paper_scale_order.txt}
DRY_SCALE=${DRY_SCALE:-smoke}
DRY_ENTRIES=${DRY_ENTRIES:-1}
DRY_BUDGET=${DRY_BUDGET:-240}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg FEDLAB_NB_DATA="$PWD/.device-data"
[ "$DEVICE" = cpu ] && [ ! -d .device-data ] && unset FEDLAB_NB_DATA   # the dry run here: the usual data paths
step() { echo "== $* ($(date -u +%T), ${SECONDS}s)"; }

step "install the carried wheels"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedlab-site \
        .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/fedlab-site:$PWD"
elif [ "$DEVICE" = cpu ]; then
    echo "no .whl: the dry run uses $PYTHON's own packages"
    export PYTHONPATH="$PWD"
else
    echo "no wheels: run benchmarks/device/prepare.sh here and carry .whl"; exit 2
fi
"$PYTHON" -c "import torch, fedlab_nb; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" || exit 3
if [ "$DEVICE" != cpu ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "DEVICE=$DEVICE but torch sees no GPU"; exit 4
fi

step "CUDA equivalence tests on $DEVICE"
FEDLAB_TEST_DEVICE=$DEVICE timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    tests/test_cuda.py tests/test_robust_rules.py -k cuda 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
if [ "$tests" != 0 ] || ! tail -n 3 "$OUT/tests.log" | grep -q " passed"; then
    echo "the equivalence tests failed or passed nothing (rc $tests): no paper scale runs on an unverified path"
    printf 'tests rc %s: stopped before any paper scale\n' "$tests" > "$SUMMARY"
    exit 5
fi

step "paper scales from $ORDER"
printf '%-20s %-18s %4s %7s  %s\n' id scale rc wall_s verdict > "$SUMMARY"
n=0
while read -r pid scale budget _rest; do
    case "$pid" in ''|'#'*) continue ;; esac
    n=$((n + 1))
    cmd=("$PYTHON" -m fedlab_nb.cli reproduce "$pid" --scale "$scale" --device "$DEVICE" -j 1 --results "$OUT/ps")
    if [ "$DEVICE" = cpu ]; then
        if [ "$n" -gt "$DRY_ENTRIES" ]; then
            printf '%-20s %-18s %4s %7s  %s\n' "$pid" "$scale" - - "not run (dry run: first $DRY_ENTRIES only)" >> "$SUMMARY"
            continue
        fi
        budget=$DRY_BUDGET
        if "$PYTHON" -c "import sys; from pathlib import Path; from fedlab_nb.repro.claims import load_paper
from fedlab_nb.repro.runner import notebook_parameters as p, notebook_path as n
sys.exit('quick' not in p(n(load_paper(sys.argv[1], Path('.')))))" "$pid"; then
            cmd=("$PYTHON" -m fedlab_nb.cli run "$pid" --scale "$scale" --device cpu -p quick True --results "$OUT/ps")
        else  # no `quick` in the notebook: the same reproduce step at the smoke scale
            scale=$DRY_SCALE
            cmd=("$PYTHON" -m fedlab_nb.cli reproduce "$pid" --scale "$scale" --device cpu -j 1 --results "$OUT/ps")
        fi
    fi
    left=$((TOTAL - (SECONDS - START) - MARGIN))
    if [ "$budget" -gt "$left" ]; then
        echo "skip $pid $scale: its budget ${budget}s does not fit the ${left}s left"
        printf '%-20s %-18s %4s %7s  %s\n' "$pid" "$scale" - - "skipped (budget ${budget}s > ${left}s left)" >> "$SUMMARY"
        continue
    fi
    step "$pid --scale $scale (budget ${budget}s): ${cmd[*]}"
    t0=$SECONDS
    timeout "$budget" "${cmd[@]}" </dev/null 2>&1 | tee "$OUT/$pid-$scale.log"
    rc=${PIPESTATUS[0]}
    wall=$((SECONDS - t0))
    verdict=$("$PYTHON" - "$OUT/ps/$pid-$scale.json" "$rc" <<'EOF'
import json, sys
path, rc = sys.argv[1], int(sys.argv[2])
if rc in (124, 137):
    print("timeout: nothing written"); sys.exit()
try:
    data = json.load(open(path))
except (OSError, ValueError):
    print(f"no result file (rc {rc})"); sys.exit()
print("failed: " + str(data["error"].get("ename")) if data.get("error") else data.get("verdict", "?"))
EOF
)
    printf '%-20s %-18s %4s %7s  %s\n' "$pid" "$scale" "$rc" "$wall" "$verdict" >> "$SUMMARY"
done < "$ORDER"

step "done: $((SECONDS - START))s"
cat "$SUMMARY"
