"""One execution per notebook in the test suite: nbval runs each notebook (its `# NBVAL_CHECK_OUTPUT` cells
compared with the stored outputs) with the kernel recording into a run folder, and one more item after the
notebook's last cell, `<notebook>::claims`, judges that paper's claims from what the kernel recorded (the
same `judge_run` as `fedlab-nb reproduce`) and compares its figure data with papers/figures/<id>.json.
`tests/test_notebook_claims.py` then leaves those papers out; run alone (`pytest tests/test_notebook_claims.py`)
it still executes each notebook with papermill, as `fedlab-nb reproduce` does."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
NBVAL_PAPERS = pytest.StashKey[dict]()   # notebook stem -> paper id, for the notebooks nbval runs this session


def _is_nbval_file(node) -> bool:
    return type(node).__name__ == "IPyNbFile"


def _papers_by_notebook() -> dict:
    """notebook stem -> paper id, for papers whose smoke run is the notebook's defaults (what nbval runs)."""
    from fedlab_nb.repro.claims import ReproError, load_paper, paper_ids
    from fedlab_nb.repro.runner import build_parameters
    out = {}
    for pid in paper_ids(ROOT):
        try:
            paper = load_paper(pid, ROOT)
            params, defaults = build_parameters(paper, "smoke", None, None)
        except ReproError:  # an invalid claims file: tests/test_notebook_claims.py reports it
            continue
        if all(params.get(k) == defaults.get(k) for k in params):
            out[Path(paper.notebook).stem] = pid
    return out


class ClaimsItem(pytest.Item):
    """The claims and figure-data check of one notebook, from nbval's execution of it."""

    def __init__(self, *, paper_id: str, **kwargs):
        super().__init__(**kwargs)
        self.paper_id = paper_id

    def runtest(self):
        from fedlab_nb.repro.claims import load_paper
        from fedlab_nb.repro.runner import build_parameters, content_hash, judge_run, mismatches
        nbfile = self.parent
        if nbfile.nodeid in _failed:
            pytest.skip("a cell of this notebook failed; nbval reports it")
        paper = load_paper(self.paper_id, ROOT)
        for module in paper.requires:
            pytest.importorskip(module)
        params, defaults = build_parameters(paper, "smoke", None, None)
        run_dir = Path(nbfile._fedlab_run_dir)
        metrics_file = run_dir / "metrics.json"
        run = {"notebook": None, "run_dir": str(run_dir), "parameters": params, "error": None,
               "metrics": json.loads(metrics_file.read_text()) if metrics_file.exists() else {},
               "wall_seconds": round(time.perf_counter() - nbfile._fedlab_t0, 2)}
        result = judge_run(paper, "smoke", params, defaults, run, run_dir.parent, content_hash(paper, params))
        wrong = mismatches(result)
        if wrong:
            pytest.fail(f"{paper.id}: verdicts differ from papers/{paper.id}.yaml:\n" + "\n".join(wrong), pytrace=False)
        import sys
        sys.path.insert(0, str(ROOT / "tests"))
        from test_figure_data import assert_figures_match
        assert_figures_match(paper, run_dir)


def pytest_collection_modifyitems(session, config, items):
    files = {}
    for item in items:
        if _is_nbval_file(item.parent):
            files.setdefault(item.parent, []).append(item)
    if not files:
        return
    by_notebook = _papers_by_notebook()
    config.stash[NBVAL_PAPERS] = {}
    for nbfile, cells in files.items():
        pid = by_notebook.get(Path(str(nbfile.path)).stem)
        if pid is None:
            continue
        config.stash[NBVAL_PAPERS][nbfile.path.stem] = pid
        claims = ClaimsItem.from_parent(nbfile, name="claims", paper_id=pid)
        items.insert(items.index(cells[-1]) + 1, claims)
    checked = set(config.stash[NBVAL_PAPERS].values())  # their papermill runs would execute them a second time
    twice = [i for i in items if i.nodeid.startswith("tests/test_notebook_claims.py::TestPaper_")
             and i.nodeid.split("::")[1][len("TestPaper_"):] in checked]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [i for i in items if i not in set(twice)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Before nbval starts a notebook's kernel (in its first cell's setup): point the kernel's recording at a
    fresh run folder, through the environment the kernel inherits."""
    nbfile = item.parent
    papers = item.config.stash.get(NBVAL_PAPERS, {})
    start = _is_nbval_file(nbfile) and not hasattr(nbfile, "_fedlab_run_dir") and nbfile.path.stem in papers
    if not start:
        yield
        return
    from fedlab_nb.repro.recording import RUN_DIR_ENV
    base = os.environ.get("FEDLAB_NB_RESULTS") or tempfile.mkdtemp(prefix="fedlab_nb_nbval_")
    run_dir = Path(base) / f"{papers[nbfile.path.stem]}-smoke"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    nbfile._fedlab_run_dir, nbfile._fedlab_t0 = str(run_dir), time.perf_counter()
    old = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(run_dir)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = old


def pytest_runtest_logreport(report):
    """Remember a failed cell so the notebook's claims item skips instead of judging a half-run notebook."""
    if report.failed and "::Cell " in report.nodeid:
        _failed.add(report.nodeid.split("::")[0])


_failed: set = set()
