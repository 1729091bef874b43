#!/usr/bin/env bash
# The whole test suite: unit tests, and every notebook executed once by nbval, whose run also judges the
# notebook's claims and figure data (conftest.py); notebooks without nbval go through papermill (tests/test_notebook_claims.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# one pytest worker per core (counted before OMP_NUM_THREADS is set: GNU nproc obeys it), one thread each
workers="${PYTEST_WORKERS:-$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MPLBACKEND=Agg PYTHONUNBUFFERED=1
# loadscope keeps every notebook's cells on one worker (nbval needs them in order, in one kernel).
exec .venv/bin/python -m pytest -n "$workers" --dist loadscope -p no:cacheprovider \
  --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg tests notebooks "$@"
