"""Every papers/*.yaml: run its notebook at smoke scale (the code path of `fedlab-nb reproduce --all
--scale smoke`) and require each claim's verdict to equal the verdict stored in the claims file, and its
figure data to stay within tolerance of papers/figures/<id>.json (skipped until that reference exists).

When nbval runs the notebooks in the same session (scripts/test.sh), each notebook executes once: the root
conftest.py judges its claims from nbval's execution (`<notebook>::claims`) and deselects its tests here.

Papers come from the repository (or $FEDLAB_NB_ROOT). Results go to a temporary folder, or to
$FEDLAB_NB_RESULTS when set (then up-to-date results are reused).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedlab_nb.repro.claims import default_root, load_paper, paper_ids
from fedlab_nb.repro.runner import mismatches, reproduce

from test_figure_data import assert_figures_match

pytestmark = pytest.mark.notebook
ROOT = default_root()  # the repository, or $FEDLAB_NB_ROOT


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    return Path(os.environ.get("FEDLAB_NB_RESULTS") or tmp_path_factory.mktemp("results"))


def check_paper(paper_id: str, results_dir: Path):
    paper = load_paper(paper_id, ROOT)  # a malformed claims file fails here, naming the field
    for module in paper.requires:  # e.g. flwr, from the optional `flower` extra
        pytest.importorskip(module)
    result = reproduce(paper_id, "smoke", root=ROOT, out_dir=results_dir)
    error = result["error"]
    assert error is None, (f"{paper.notebook} failed in cell {error['cell']}: {error['ename']}: {error['evalue']} "
                           f"(executed notebook: {results_dir / result['notebook']})")
    assert not mismatches(result), "\n".join(mismatches(result))


def check_figures(paper_id: str, results_dir: Path):
    """The run's figure data (save_figure's *.data.json) against papers/figures/<id>.json, if it exists."""
    paper = load_paper(paper_id, ROOT)
    for module in paper.requires:
        pytest.importorskip(module)
    result = reproduce(paper_id, "smoke", root=ROOT, out_dir=results_dir)  # up to date after the claims test
    if "figure_data" not in result:  # a stored result from before figure data was recorded
        result = reproduce(paper_id, "smoke", root=ROOT, out_dir=results_dir, force=True)
    if result["error"]:
        pytest.skip("the notebook failed; test_claims_match_stored_verdicts reports it")
    assert_figures_match(paper, results_dir / f"{paper_id}-smoke")


def _paper_class(paper_id: str):
    """One test class per paper, so `pytest -n 2 --dist loadscope` spreads the notebooks over workers."""
    def test_claims_match_stored_verdicts(self, results_dir):
        check_paper(paper_id, results_dir)

    def test_figures_match_reference(self, results_dir):
        check_figures(paper_id, results_dir)
    return type(f"TestPaper_{paper_id}", (), {"test_claims_match_stored_verdicts": test_claims_match_stored_verdicts,
                                              "test_figures_match_reference": test_figures_match_reference})


for _id in paper_ids(ROOT):
    globals()[f"TestPaper_{_id}"] = _paper_class(_id)


class TestPapermillParameters:
    """A notebook re-run by papermill with other parameters executes and records what its claims need."""

    def test_partitions_with_changed_parameters(self, results_dir):
        from fedlab_nb.repro.runner import run_notebook
        params = {"n_clients": 10, "alphas": [0.1, 10.0], "n_seeds": 1, "synthetic_clients": 10, "seed": 3}
        run = run_notebook("partitions", "smoke", parameters=params, out_dir=results_dir / "changed")
        assert run["error"] is None, run["error"]
        assert run["parameters"]["n_clients"] == 10
        assert run["metrics"]["all_disjoint_complete"] is True
        assert run["metrics"]["emd_falls_as_alpha_grows"] is True
