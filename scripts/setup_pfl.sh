#!/usr/bin/env bash
# Create (or update) .venv-pfl: Apple's pfl-research (PyPI `pfl` 0.6.0) for benchmarks/bench_pfl.py.
# A separate environment, never the project's .venv: pfl pins dp-accounting<0.6, which conflicts with flwr[dp].
# The benchmark runs pfl's side in this environment as a subprocess; it needs no fedlab_nb here (the fedlab_nb
# side exports the partitions, the initial weights and the test set to a folder this side reads).
# Idempotent: re-running is cheap.   Usage: bash scripts/setup_pfl.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
[ -x .venv-pfl/bin/python ] || "$py" -m venv .venv-pfl
pip=(.venv-pfl/bin/pip install -q)
# The CPU wheel of torch FIRST and alone (the same version as the project's .venv, so both sides run the same
# kernels); pfl[pytorch] would otherwise pull a multi-GB CUDA build. As in scripts/setup.sh, a plain
# `torch==2.13.0` finds the CPU wheel where pip's configuration offers it (find-links); elsewhere set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu.
.venv-pfl/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
# pfl itself, with torch pinned to the one just installed, and what the pfl side of the benchmark imports (numpy:
# it reads the data that the fedlab_nb side exported, so no data set loaders, pandas or mlxtend are needed here).
"${pip[@]}" "pfl[pytorch]==0.6.0" "torch==2.13.0" numpy
.venv-pfl/bin/python -c "import torch; from importlib.metadata import version; from pfl.model.pytorch import PyTorchModel; \
print('pfl', version('pfl'), '| torch', torch.__version__)"
.venv-pfl/bin/python -c "import torch; assert torch.version.cuda is None, torch.__version__" \
  || echo "note: .venv-pfl has a CUDA build of torch; the CPU benchmark still runs, the project's .venv has the CPU one"
