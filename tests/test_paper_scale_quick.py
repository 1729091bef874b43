"""Issue 41 item 3: CI does not run paper scale, but it runs each paper-scale notebook (the papers whose
`paper_scale.status` is "runs here") with `-p quick True`: the paper's code path on a tiny budget (a round or
two, two seeds), so that code stays green. A quick run is a code-path test, never a result: `reproduce` and
`scripts/paper_scale.py store` refuse it (fedlab_nb.repro.runner.refuse_quick)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from fedlab_nb.repro import claims as C
from fedlab_nb.repro.runner import (QUICK, ParameterError, judge_run, notebook_parameters, notebook_path,
                                    refuse_quick, reproduce)

ROOT = Path(__file__).resolve().parents[1]
RUNS_HERE = sorted(pid for pid in C.paper_ids(ROOT)
                   if (C.load_paper(pid, ROOT).paper_scale or {}).get("status") == "runs here")
CUT = 'if scale == "paper" and quick:'


def test_some_papers_run_here():
    assert len(RUNS_HERE) >= 13


@pytest.mark.parametrize("pid", RUNS_HERE)
def test_every_paper_scale_notebook_declares_quick(pid):
    """A `quick = False` parameter (so `-p quick True` is accepted), applied in code after the paper scale's own
    overrides (which would otherwise undo a `-p` cut of the same names)."""
    path = notebook_path(C.load_paper(pid, ROOT))
    assert notebook_parameters(path).get(QUICK) is False, f"{path.name}: no `quick = False` in its parameters cell"
    sources = [c.source for c in nbformat.read(str(path), as_version=4).cells if c.cell_type == "code"]
    cut = [s for s in sources if CUT in s]
    assert len(cut) == 1, f"{path.name}: one cell should hold `{CUT}`"
    lines = cut[0].splitlines()
    after = [i for i, line in enumerate(lines) if line.startswith('if scale == "paper":')]
    assert all(i < lines.index(next(line for line in lines if line.startswith(CUT))) for i in after), \
        f"{path.name}: the quick cut must come after the paper scale's overrides"


# ---------------------------------------------------------------------------------------------- never a result
def _tiny_with_quick(tmp_path) -> Path:
    """tests/data/tinyroot with a `quick` parameter in its notebook."""
    root = tmp_path / "root"
    shutil.copytree(ROOT / "tests" / "data" / "tinyroot", root)
    path = root / "notebooks" / "tiny.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += "\nquick = False"
    nbformat.write(nb, str(path))
    return root


def test_reproduce_refuses_a_quick_run(tmp_path):
    root = _tiny_with_quick(tmp_path)
    with pytest.raises(ParameterError, match="quick=True.*not a result"):
        reproduce("tiny", "paper", parameters={"quick": True}, root=root, out_dir=tmp_path / "results")
    assert not (tmp_path / "results" / "tiny-paper.json").exists()
    paper = C.load_paper("tiny", root)
    run = {"notebook": None, "run_dir": str(tmp_path), "metrics": {"value": 1.0}, "error": None, "wall_seconds": 1}
    with pytest.raises(ParameterError, match="quick=True"):  # the one writer of results/<id>-<scale>.json
        judge_run(paper, "paper", {"quick": True}, {}, run, tmp_path, "digest")
    assert not (tmp_path / "tiny-paper.json").exists()
    refuse_quick({"quick": False}, "fine")
    refuse_quick({}, "fine")


def test_store_refuses_a_quick_run(tmp_path):
    spec = importlib.util.spec_from_file_location("paper_scale", ROOT / "scripts" / "paper_scale.py")
    paper_scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paper_scale)
    root, results = _tiny_with_quick(tmp_path), tmp_path / "results"
    results.mkdir()
    result = {"paper": "tiny", "scale": "paper", "verdict": C.REPRODUCED, "error": None, "figures": [],
              "figure_data": [], "claims": [{"id": "value_positive", "verdict": C.REPRODUCED, "expect": "> 0"}],
              "parameters": {"value": 2.0, "quick": True}}
    (results / "tiny-paper.json").write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="quick run .* is not a paper-scale result; nothing stored"):
        paper_scale.store("tiny", results, root)
    assert not (root / "papers" / "paper_scale").exists()
    result["parameters"]["quick"] = False  # the same result without quick is stored
    (results / "tiny-paper.json").write_text(json.dumps(result))
    assert paper_scale.store("tiny", results, root).is_file()


# ---------------------------------------------------------------------------------------------- the code path
def _quick_class(pid: str):
    """One class per paper, so that `pytest -n N --dist loadscope` spreads the runs over the workers."""
    def test_paper_scale_runs_quick(self, tmp_path):
        from fedlab_nb.cli import main
        paper = C.load_paper(pid, ROOT)
        for module in paper.requires:
            pytest.importorskip(module)
        rc = main(["--root", str(ROOT), "--results", str(tmp_path), "run", pid, "--scale", "paper",
                   "-p", "quick", "True"])
        folders = list((tmp_path / "runs").glob(f"{pid}-paper-*"))
        assert len(folders) == 1
        assert rc == 0, f"the quick paper-scale run of {pid} failed: see {folders[0] / f'{pid}-paper.ipynb'}"
        recorded = json.loads((folders[0] / "parameters.json").read_text())
        assert recorded["parameters"][QUICK] is True and recorded["scale"] == "paper"
        metrics = json.loads((folders[0] / f"{pid}-paper" / "metrics.json").read_text())
        missing = sorted({c.metric for c in paper.claims} - set(metrics))
        assert not missing, f"{pid}: the quick run did not record {missing}"
    return type(f"TestQuick_{pid}", (), {"test_paper_scale_runs_quick": pytest.mark.notebook(test_paper_scale_runs_quick)})


for _id in RUNS_HERE:
    globals()[f"TestQuick_{_id}"] = _quick_class(_id)
