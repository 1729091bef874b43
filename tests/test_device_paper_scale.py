"""Issue 41 item 5: benchmarks/device/paper_scale.sh runs the GPU paper scales of paper_scale_order.txt in one
device call. Fast checks, no notebook runs: the order names existing papers and scales whose device is cuda, with
budgets that fit one call, and the script is valid bash that runs the CUDA tests before any paper scale."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fedlab_nb.repro import claims as C

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device" / "paper_scale.sh"
ORDER = ROOT / "benchmarks" / "device" / "paper_scale_order.txt"
CALL_SECONDS = 600  # the device tool's limit on one command


def _entries() -> list[tuple[str, str, int]]:
    rows = []
    for line in ORDER.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            assert len(fields) == 4, f"{ORDER.name}: want `id scale budget_s est_min`, got {line!r}"
            rows.append((fields[0], fields[1], int(fields[2])))
    return rows


def test_order_is_not_empty_and_has_no_repeats():
    rows = _entries()
    assert rows
    assert len({(pid, scale) for pid, scale, _ in rows}) == len(rows)


@pytest.mark.parametrize("pid,scale,budget", _entries())
def test_order_names_a_cuda_scale_of_an_existing_paper(pid, scale, budget):
    assert pid in C.paper_ids(ROOT), f"{pid}: no papers/{pid}.yaml"
    scales = C.load_paper(pid, ROOT).scales
    assert scale in scales, f"{pid}: no scale {scale!r} (has {sorted(scales)})"
    assert scales[scale]["device"] == "cuda", f"{pid} {scale}: device {scales[scale]['device']}, not cuda"
    assert 0 < budget < CALL_SECONDS


def test_every_needs_a_gpu_paper_with_a_cuda_scale_is_in_the_order():
    ordered = {pid for pid, _, _ in _entries()}
    for pid in C.paper_ids(ROOT):
        paper = C.load_paper(pid, ROOT)
        if (paper.paper_scale or {}).get("status") == "needs a GPU" and \
                any(s["device"] == "cuda" for s in paper.scales.values()):
            assert pid in ordered, f"{pid} needs a GPU and has a cuda scale but is not in {ORDER.name}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_script_runs_the_cuda_tests_before_any_paper_scale_and_stops_on_failure():
    text = SCRIPT.read_text()
    assert text.index("tests/test_cuda.py") < text.index("fedlab_nb.cli reproduce")
    assert "exit 5" in text[text.index("tests/test_cuda.py"):text.index("paper scales from")]
