"""The reproduction harness: expectation grammar, verdicts, claims-file validation, recording, and the
tiny fixture notebook (tests/data/tinyroot) run end to end through reproduce + report."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedlab_nb import repro
from fedlab_nb.repro import claims as C
from fedlab_nb.repro import recording as R
from fedlab_nb.repro.expect import ExpectationError, MetricError, parse_expectation
from fedlab_nb.repro.report import build_report
from fedlab_nb.repro.runner import ParameterError, mismatches, reproduce, run_notebook

FIXTURE = Path(__file__).parent / "data" / "tinyroot"
REPO = Path(__file__).resolve().parents[1]


def holds(expect: str, value, **metrics) -> bool:
    return parse_expectation(expect).holds(value, metrics)


# ---------------------------------------------------------------------------------------------- grammar
@pytest.mark.parametrize("expect, value, expected", [
    ("< 1e-6", 1e-7, True), ("< 1e-6", 1e-5, False),
    ("<= 0.5", 0.5, True), ("> 0.5", 0.5, False), (">= 0.5", 0.5, True),
    ("== 3", 3, True), ("== 3", 3.5, False), ("== true", True, True), ('== "sgd"', "sgd", True),
    ("> -1", -0.5, True), ("< -1", -0.5, False),
    ("within 0.05 of 0.91", 0.95, True), ("within 0.05 of 0.91", 0.97, False),
    ("within 5% of 100", 104, True), ("within 5% of 100", 106, False),
    ("between 0.4 and 0.6", 0.6, True), ("between 0.4 and 0.6", 0.61, False),
])
def test_expectation_forms(expect, value, expected):
    assert holds(expect, value) is expected


def test_expectation_refers_to_other_metrics():
    assert holds("> fedavg_acc + 0.02", 0.83, fedavg_acc=0.80)
    assert not holds("> fedavg_acc + 0.02", 0.81, fedavg_acc=0.80)
    assert holds("< 0.5 * fedavg_dist", 0.9, fedavg_dist=2.0)
    assert not holds("< 0.5 * fedavg_dist", 1.1, fedavg_dist=2.0)
    assert holds("within 0.01 of fedavg_acc - 0.1", 0.7, fedavg_acc=0.8)
    assert holds("between low and 2 * low", 1.5, low=1.0)
    assert holds("< 2 * (a + 1)", 5.9, a=2.0)  # precedence: * binds tighter, parentheses override
    assert parse_expectation("> a + 0.5 * b").names == {"a", "b"}


@pytest.mark.parametrize("bad", ["", "0.5", "< ", "<< 1", "> 1 1", "within x of 1", "within 1 0.5",
                                 "between 1 or 2", "> import os", "> 1 ; 2", "> __import__('os')"])
def test_expectation_errors(bad):
    with pytest.raises(ExpectationError):
        parse_expectation(bad)


def test_expectation_needs_recorded_finite_metrics():
    with pytest.raises(MetricError, match="fedavg_acc was not recorded"):
        holds("> fedavg_acc", 0.5)
    with pytest.raises(MetricError, match="NaN"):
        holds("> fedavg_acc", 0.5, fedavg_acc=None)
    with pytest.raises(MetricError, match="NaN"):
        holds("> 0", float("nan"))


# ---------------------------------------------------------------------------------------------- verdicts
def claim(expect="> 0.9", partial=None, metric="acc"):
    return C.Claim(id="c", text="t", metric=metric, expect=parse_expectation(expect),
                   partial=parse_expectation(partial) if partial else None, paper_value=None,
                   verdict=C.REPRODUCED, note=None)


def test_verdicts():
    assert C.judge(claim(), {"acc": 0.95}) == (C.REPRODUCED, None)
    assert C.judge(claim(partial="> 0.8"), {"acc": 0.85}) == (C.PARTIAL, None)
    assert C.judge(claim(partial="> 0.8"), {"acc": 0.5}) == (C.NOT_REPRODUCED, None)
    assert C.judge(claim(), {"acc": 0.5}) == (C.NOT_REPRODUCED, None)
    assert C.judge(claim(), {}) == (C.ERROR, "metric acc was not recorded")
    verdict, reason = C.judge(claim(), {"acc": None})
    assert verdict == C.ERROR and "NaN" in reason
    verdict, reason = C.judge(claim(), {"acc": "high"})  # a string cannot be compared with '>'
    assert verdict == C.ERROR and "cannot evaluate" in reason


def test_paper_verdict_summary():
    assert C.paper_verdict([C.REPRODUCED, C.REPRODUCED]) == C.REPRODUCED
    assert C.paper_verdict([C.REPRODUCED, C.NOT_REPRODUCED]) == C.PARTIAL
    assert C.paper_verdict([C.PARTIAL]) == C.PARTIAL
    assert C.paper_verdict([C.NOT_REPRODUCED, C.NOT_REPRODUCED]) == C.NOT_REPRODUCED
    assert C.paper_verdict([C.REPRODUCED, C.ERROR]) == C.ERROR


def test_claim_line_has_no_measured_numbers():
    line = C.claim_line(claim("< 1e-6", metric="max_abs_diff"), C.REPRODUCED)
    assert line == "c (max_abs_diff < 1e-6): REPRODUCED"
    assert C.claim_line(claim(), C.ERROR, "metric acc was not recorded") == \
        "c (acc > 0.9): ERROR (metric acc was not recorded)"


# ---------------------------------------------------------------------------------------------- claims files
def fixture_claims() -> dict:
    return yaml.safe_load((FIXTURE / "papers" / "tiny.yaml").read_text())


def write_claims(tmp_path: Path, data: dict, name="tiny") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_fixture_claims_file_loads():
    paper = C.load_claims(FIXTURE / "papers" / "tiny.yaml")
    assert paper.id == "tiny" and paper.notebook == "notebooks/tiny.ipynb"
    assert [c.verdict for c in paper.claims] == [C.REPRODUCED, C.REPRODUCED, C.PARTIAL, C.NOT_REPRODUCED]
    assert paper.scales["smoke"]["parameters"] == {"n_points": 4}


def _drop(key):
    return lambda d: d.pop(key)


@pytest.mark.parametrize("edit, field, expected", [
    (_drop("method"), "method", "present"),
    (lambda d: d.update(id="other"), "id", "'tiny'"),
    (lambda d: d.update(extra=1), "extra", "one of"),
    (lambda d: d["paper"].update(year="2024"), "paper.year", "integer year"),
    (lambda d: d["scales"].pop("smoke"), "scales", "'smoke'"),
    (lambda d: d["scales"]["smoke"].update(parameters=[1]), "scales.smoke.parameters", "mapping"),
    (lambda d: d.update(claims=[]), "claims", "non-empty list"),
    (lambda d: d["claims"][0].pop("metric"), "claims[0].metric", "present"),
    (lambda d: d["claims"][0].update(expect="about 1"), "claims[0].expect", "cannot be parsed"),
    (lambda d: d["claims"][0].update(expect=0.5), "claims[0].expect", "cannot be parsed"),
    (lambda d: d["claims"][2].update(partial="> > 1"), "claims[2].partial", "cannot be parsed"),
    (lambda d: d["claims"][0].update(verdict="ok"), "claims[0].verdict", "partially reproduced"),
    (lambda d: d["claims"][3].pop("note"), "claims[3].note", "what was tried"),
    (lambda d: d["claims"][1].update(id="value_positive"), "claims[1].id", "unique"),
    (lambda d: d["claims"][0].update(expected="> 1"), "claims[0].expected", "one of"),
])
def test_claims_file_errors_name_file_and_field(tmp_path, edit, field, expected):
    data = fixture_claims()
    edit(data)
    path = write_claims(tmp_path, data)
    with pytest.raises(C.ClaimsFileError) as info:
        C.load_claims(path)
    message = str(info.value)
    assert str(path) in message and f"'{field}'" in message and expected in message


def test_claims_file_not_yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("id: [unclosed\n")
    with pytest.raises(C.ClaimsFileError, match="not valid YAML"):
        C.load_claims(path)


def test_unknown_paper_suggests_close_matches(tmp_path):
    root = make_root(tmp_path)
    with pytest.raises(C.UnknownPaperError, match="did you mean tiny"):
        C.claims_path("tinny", root)


# ---------------------------------------------------------------------------------------------- recording
@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_metrics", {})
    monkeypatch.setenv(R.RUN_DIR_ENV, str(tmp_path / "run"))
    return tmp_path / "run"


def test_record_converts_scalars_and_writes_sidecar(run_dir):
    repro.record("acc", np.float32(0.5))
    repro.record("steps", torch.tensor(7))
    repro.record("ok", np.bool_(True))
    repro.record("bad", float("nan"))
    repro.record("acc", 0.75)  # a second record of the same name replaces it
    stored = json.loads((run_dir / "metrics.json").read_text())
    assert stored == {"acc": 0.75, "steps": 7, "ok": True, "bad": None}
    assert type(stored["steps"]) is int and repro.recorded() == stored


def test_record_refuses_2d_arrays_and_bad_names(run_dir):
    with pytest.raises(TypeError, match="1-D sequence"):  # 1-D sequences are per-seed values (test_verdicts.py)
        repro.record("acc", np.ones((3, 2)))
    with pytest.raises(TypeError, match="number, bool, str or a 1-D sequence"):
        repro.record("acc", {"a": 1})
    with pytest.raises(ValueError, match="identifier"):
        repro.record("final acc", 1.0)


def test_record_without_run_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_metrics", {})
    monkeypatch.delenv(R.RUN_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    repro.record("acc", 0.5)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, _ = plt.subplots()
    assert repro.save_figure(fig) is None
    plt.close(fig)
    assert repro.recorded() == {"acc": 0.5} and list(tmp_path.iterdir()) == []


def test_save_figure_writes_png(run_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    repro.save_figure(ax, name="curve")  # an Axes is accepted through its .figure
    plt.close(fig)
    assert (run_dir / "curve.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="simple file name"):
        repro.save_figure(fig, name="../evil")


def test_check_claims_prints_stable_lines(tmp_path, monkeypatch, capsys):
    root = make_root(tmp_path)
    monkeypatch.delenv(C.ROOT_ENV, raising=False)
    monkeypatch.chdir(root / "notebooks")  # found by walking up from the notebook's folder
    repro.check_claims("tiny", {"value": 0.5, "double": 1.0})
    assert capsys.readouterr().out.splitlines() == [
        "value_positive (value > 0): REPRODUCED",
        "double_is_twice (double within 1e-9 of 2 * value): REPRODUCED",
        "value_large (value > 0.9): PARTIALLY REPRODUCED",
        "value_huge (value >= 10): NOT REPRODUCED AT THIS SCALE",
    ]
    repro.check_claims("tiny", {"value": None})
    out = capsys.readouterr().out
    assert "value_positive (value > 0): ERROR (metric value is NaN or infinite)" in out
    assert "ERROR (metric double was not recorded)" in out


# ---------------------------------------------------------------------------------------------- end to end
def make_root(tmp_path: Path, edit=None) -> Path:
    """A copy of the fixture repository (papers/ + notebooks/); `edit` may change the claims dict."""
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    if edit is not None:
        data = fixture_claims()
        edit(data)
        write_claims(root / "papers", data)
    return root


def add_paper(root: Path, name: str, **scale_parameters) -> None:
    """Another paper using the same notebook (e.g. one that fails)."""
    data = fixture_claims()
    data["id"] = name
    data["scales"]["smoke"]["parameters"] = scale_parameters
    write_claims(root / "papers", data, name)


@pytest.mark.notebook
def test_reproduce_and_report_end_to_end(tmp_path):
    root, out = make_root(tmp_path), tmp_path / "results"
    result = reproduce("tiny", "smoke", root=root, out_dir=out)
    assert result["error"] is None and not mismatches(result)
    assert result["metrics"] == {"value": 0.5, "double": 1.0}
    assert result["parameters"] == {"n_points": 4, "scale": "smoke"}
    assert result["verdict"] == C.PARTIAL and result["seed"] == 0 and result["device"] == "cpu"
    assert set(result["versions"]) >= {"torch", "numpy", "papermill", "python", "fedlab_nb"}
    assert json.loads((out / "tiny-smoke.json").read_text())["hash"] == result["hash"]
    assert (out / "tiny-smoke.ipynb").is_file() and result["figures"] == ["tiny-smoke/main.png"]

    text = build_report(out)
    assert "| tiny | smoke | headline | value_large | 1.0 (Eq. 2) | 0.5 | > 0.9 (partial: between 0.25 and 0.9) | " \
           "partially reproduced |" in text
    # the first table: one row per paper, the headline verdict with the checks and supporting claims beside it
    assert "| tiny | smoke | value_positive: the recorded value is positive (reproduced) · value_large: the value " \
           "is large (partially reproduced) | none: a fixture: there is no paper · 1.0 (Eq. 2) | 0.5 · 0.5 | " in text
    assert "| paper | partially reproduced (supporting 0/1 reproduced; checks 1/1 hold) |" in text
    page = (out / "index.html").read_text()
    assert 'loading="lazy"' in page and 'src="tiny-smoke/main.png"' in page and "partially reproduced" in page
    assert (out / "REPORT.md").read_text() == text

    # up to date -> skipped without running; a changed parameter or --force runs again
    assert reproduce("tiny", "smoke", root=root, out_dir=out).get("skipped") is True
    again = reproduce("tiny", "smoke", root=root, out_dir=out, parameters={"value": 20})
    assert not again.get("skipped") and again["metrics"]["value"] == 20.0  # int given for a float -> float
    assert [c["verdict"] for c in again["claims"]][-1] == C.REPRODUCED
    assert reproduce("tiny", "smoke", root=root, out_dir=out, parameters={"value": 20}).get("skipped")
    forced = reproduce("tiny", "smoke", root=root, out_dir=out, parameters={"value": 20}, force=True)
    assert not forced.get("skipped") and forced["timestamp"] >= again["timestamp"]


@pytest.mark.notebook
def test_false_expectation_makes_the_check_fail(tmp_path):
    """Acceptance: changing a claim's expectation to something false makes the claim check fail."""
    def falsify(data):
        data["claims"][0]["expect"] = "> 100"  # value is 0.5: now false, still stored as 'reproduced'
    root = make_root(tmp_path, falsify)
    result = reproduce("tiny", "smoke", root=root, out_dir=tmp_path / "results")
    assert result["claims"][0]["verdict"] == C.NOT_REPRODUCED
    assert result["claims"][0]["stored_verdict"] == C.REPRODUCED
    assert mismatches(result) == ["value_positive: got 'not reproduced at this scale', "
                                  "claims file says 'reproduced'"]
    with pytest.raises(AssertionError):  # the exact check tests/test_notebook_claims.py makes
        assert not mismatches(result)


@pytest.mark.notebook
def test_false_expectation_fails_nbval(tmp_path):
    """The same change fails nbval: the claims cell's stored output no longer matches."""
    def falsify(data):
        data["claims"][0]["expect"] = "> 100"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-sanitize-with", str(REPO / "notebooks" / "sanitize.cfg")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(C.ROOT_ENV, None)
    env.pop(R.RUN_DIR_ENV, None)
    for edit, code in ((None, 0), (falsify, 1)):
        root = make_root(tmp_path / str(code), edit)
        run = subprocess.run(cmd + [str(root / "notebooks" / "tiny.ipynb")], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == code, run.stdout[-2000:]


@pytest.mark.notebook
def test_failing_notebook_is_reported_and_others_kept(tmp_path):
    root, out = make_root(tmp_path), tmp_path / "results"
    add_paper(root, "broken", fail=True)
    good = reproduce("tiny", "smoke", root=root, out_dir=out)
    bad = reproduce("broken", "smoke", root=root, out_dir=out)
    assert bad["verdict"] == C.ERROR
    assert bad["error"]["ename"] == "RuntimeError" and bad["error"]["evalue"] == "asked to fail"
    assert isinstance(bad["error"]["cell"], int)
    assert all(c["verdict"] == C.ERROR and "notebook failed in cell" in c["reason"] for c in bad["claims"])
    assert (out / "broken-smoke.ipynb").is_file()  # the executed notebook keeps the traceback
    assert json.loads((out / "tiny-smoke.json").read_text())["hash"] == good["hash"]  # untouched
    assert "asked to fail" in build_report(out)
    # an error is never 'up to date': the next call runs it again
    assert not reproduce("broken", "smoke", root=root, out_dir=out).get("skipped")


def test_parameter_validation(tmp_path):
    root = make_root(tmp_path)
    with pytest.raises(ParameterError, match=r"unknown parameter 'alpha'.*valid: device, fail, n_points"):
        run_notebook("tiny", parameters={"alpha": 0.1}, root=root, out_dir=tmp_path / "r")
    with pytest.raises(ParameterError, match=r"'n_points' .* has type int .*got float 2.5"):
        run_notebook("tiny", parameters={"n_points": 2.5}, root=root, out_dir=tmp_path / "r")
    with pytest.raises(ParameterError, match=r"'fail' .* has type bool .*got int 1"):
        run_notebook("tiny", parameters={"fail": 1}, root=root, out_dir=tmp_path / "r")
    with pytest.raises(ParameterError, match="no scale 'huge'; scales: smoke, paper"):
        run_notebook("tiny", scale="huge", root=root, out_dir=tmp_path / "r")
    with pytest.raises(C.UnknownPaperError, match="did you mean tiny"):
        reproduce("tiy", root=root, out_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()  # nothing ran, nothing written


# ---------------------------------------------------------------------------------------------- also_seen
def _seeded(data, i=1, **extra):
    data["claims"][i].update(seeds=5, role="supporting", **extra)  # a seeded claim is not a check
    return data


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d["claims"][0].update(also_seen={C.INCONCLUSIVE: "elsewhere"}), "single-run claim"),
    (lambda d: _seeded(d, also_seen={C.NOT_REPRODUCED: "another CPU, margin -0.01 ± 0.005"}), "both reproduced and not"),
    (lambda d: _seeded(d, also_seen={C.REPRODUCED: "same as stored"}), "other than the stored"),
    (lambda d: _seeded(d, also_seen={"ok": "x"}), "other than the stored"),
    (lambda d: _seeded(d, also_seen={C.INCONCLUSIVE: ""}), "where it was seen"),
    (lambda d: _seeded(d, also_seen=[C.INCONCLUSIVE]), "a mapping"),
])
def test_also_seen_is_refused_where_it_would_hide_a_flip(tmp_path, edit, expected):
    data = fixture_claims()
    edit(data)
    with pytest.raises(C.ClaimsFileError, match=expected):
        C.load_claims(write_claims(tmp_path, data))


def test_also_seen_accepts_only_the_listed_adjacent_verdict(tmp_path):
    data = _seeded(fixture_claims(), also_seen={C.INCONCLUSIVE: "another CPU: margin +0.01 ± 0.02"})
    seen = C.load_claims(write_claims(tmp_path, data)).claims[1]
    assert seen.accepted == (C.REPRODUCED, C.INCONCLUSIVE)
    row = {"id": seen.id, "stored_verdict": seen.verdict, "also_seen": seen.also_seen, "reason": None}
    assert mismatches({"claims": [dict(row, verdict=C.INCONCLUSIVE)]}) == []
    wrong = mismatches({"claims": [dict(row, verdict=C.NOT_REPRODUCED)]})
    assert wrong == [f"{seen.id}: got 'not reproduced at this scale', claims file says 'reproduced' or "
                     "'inconclusive at this scale'"]


def test_also_seen_line_is_the_same_for_nbval_whichever_accepted_verdict_a_run_gives():
    import configparser
    import re
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parents[1] / "notebooks" / "sanitize.cfg")
    rule = cfg["also_seen_run_verdict"]
    c = C.Claim(id="c", text="t", metric="acc", expect=parse_expectation("> 0.9"), partial=None, paper_value=None,
                verdict=C.REPRODUCED, note=None, seeds=5, also_seen={C.INCONCLUSIVE: "another CPU"})
    lines = {v: C.claim_line(c, v) for v in (C.REPRODUCED, C.INCONCLUSIVE, C.NOT_REPRODUCED)}
    assert lines[C.INCONCLUSIVE] == "c (acc > 0.9, 5 seeds): REPRODUCED or INCONCLUSIVE AT THIS SCALE (this run: " \
                                    "INCONCLUSIVE AT THIS SCALE)"
    masked = {v: re.sub(rule["regex"], rule["replace"], line) for v, line in lines.items()}
    assert len(set(masked.values())) == 1   # nbval cannot tell them apart: the claims check must (mismatches)
    assert C.claim_line(c, C.ERROR, "metric acc was not recorded").endswith("ERROR (metric acc was not recorded)")
