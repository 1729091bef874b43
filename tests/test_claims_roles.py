"""Claims files, version 3: roles, the paper's number, what was implemented, and the refusals that keep a
claim able to fail (papers/SCHEMA.md, "Version 3")."""
from __future__ import annotations

import pytest
import yaml

from fedlab_nb.repro import claims as C
from fedlab_nb.repro.expect import ExpectationError, covers, parse_expectation
from fedlab_nb.repro.report import beside, headline_rows, summary_lines, verdict_label

from test_repro import fixture_claims, write_claims


def _load(tmp_path, edit):
    data = fixture_claims()
    edit(data)
    return C.load_claims(write_claims(tmp_path, data))


def _bounded(expect, span=(0, 1), metric="auroc_attack", **extra):
    def edit(d):
        d["claims"][2].update(metric=metric, expect=expect, range=list(span), **extra)
        d["claims"][2].pop("partial")
    return edit


# ---------------------------------------------------------------------------------------------- cannot fail
@pytest.mark.parametrize("expect, span", [
    ("between 0 and 1", (0, 1)), ("between -1 and 1", (-1, 1)), ("between -2 and 2", (-1, 1)),
    (">= 0", (0, 1)), ("> -0.5", (0, 1)), ("<= 1", (0, 1)), ("< 1.01", (0, 1)), (">= -1", (-1, 1)),
    ("within 0.5 of 0.5", (0, 1)), ("within 100% of 0.5", (0, 1)), ("between 0 - 1 and 2 * 1", (-1, 1)),
    ("<= 1 + 0", (0, 1)),
])
def test_an_expectation_that_holds_on_the_whole_range_is_refused(tmp_path, expect, span):
    with pytest.raises(C.ClaimsFileError, match=r"claims\[2\]\.expect.*cannot fail.*report:"):
        _load(tmp_path, _bounded(expect, span))


@pytest.mark.parametrize("expect", ["> 0.95", "between 0.1 and 1", ">= 0.5", "< 1", "> 0", "within 0.1 of 0.9",
                                    "> other_metric", "between other_metric and 1"])
def test_an_expectation_that_some_value_fails_is_kept(tmp_path, expect):
    paper = _load(tmp_path, _bounded(expect))
    assert paper.claims[2].range == (0.0, 1.0)


def test_a_cannot_fail_partial_is_refused_too(tmp_path):
    with pytest.raises(C.ClaimsFileError, match=r"claims\[2\]\.partial.*cannot fail"):
        _load(tmp_path, lambda d: d["claims"][2].update(metric="acc", range=[0, 1], partial="between 0 and 1"))


@pytest.mark.parametrize("metric", ["final_acc", "auroc", "acc_gain", "spearman_score_shapley", "cos_to_mean",
                                    "frac_wins", "prob_member"])
def test_a_bounded_metric_must_declare_its_range(tmp_path, metric):
    with pytest.raises(C.ClaimsFileError, match=rf"claims\[2\]\.range.*is missing for metric '{metric}'"):
        _load(tmp_path, lambda d: d["claims"][2].update(metric=metric))


@pytest.mark.parametrize("span", [[1, 0], [0], [0, "1"], [0, float("inf")], "0..1"])
def test_a_range_is_two_finite_increasing_numbers(tmp_path, span):
    with pytest.raises(C.ClaimsFileError, match=r"claims\[2\]\.range"):
        _load(tmp_path, lambda d: d["claims"][2].update(range=span))


def test_covers_is_false_for_expectations_naming_metrics():
    assert not covers(parse_expectation("> fedavg_acc - 2"), 0, 1)  # not decidable from the text alone
    assert covers(parse_expectation("== 1"), 1, 1) and not covers(parse_expectation("== 1"), 0, 1)


# ---------------------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("expect", ["< 1e999", "> -1e400", "between 0 and 1e999", "within 1e999 of 0", "< inf",
                                    "> -Infinity", "< NaN", "< 2 * 1e500"])
def test_a_non_finite_number_in_an_expectation_is_refused(tmp_path, expect):
    with pytest.raises(ExpectationError, match="not finite|finite number|finite number tolerance"):
        parse_expectation(expect)
    with pytest.raises(C.ClaimsFileError, match=r"claims\[0\]\.expect.*cannot be parsed"):
        _load(tmp_path, lambda d: d["claims"][0].update(expect=expect))


# ---------------------------------------------------------------------------------------------- YAML
def _text(tmp_path, text: str):
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    return path


def test_a_duplicate_key_is_refused_with_its_line(tmp_path):
    text = yaml.safe_dump(fixture_claims(), sort_keys=False).replace("  expect: '> 0'\n",
                                                                     "  expect: '> 0'\n  expect: '> 100'\n", 1)
    with pytest.raises(C.ClaimsFileError, match=r"duplicate key 'expect'.*delete one.*line \d+"):
        C.load_claims(_text(tmp_path, text))
    top = yaml.safe_dump(fixture_claims(), sort_keys=False) + "id: tiny\n"
    with pytest.raises(C.ClaimsFileError, match="duplicate key 'id'"):
        C.load_claims(_text(tmp_path, top))


def test_aliases_are_refused_before_they_expand(tmp_path):
    bomb = "".join(f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n"
                   for i in range(1, 8))
    text = yaml.safe_dump(fixture_claims(), sort_keys=False).replace(
        "parameters:\n      n_points: 4", "parameters:\n      n_points: 4\n      a: &a [1, 2]\n      x: *a")
    with pytest.raises(C.ClaimsFileError, match=r"aliases \(\*name\) are not allowed"):
        C.load_claims(_text(tmp_path, text))
    with pytest.raises(C.ClaimsFileError, match="aliases"):
        C.load_claims(_text(tmp_path, "a: &a [1]\n" + bomb))


def test_an_oversized_or_non_utf8_claims_file_is_refused(tmp_path):
    with pytest.raises(C.ClaimsFileError, match="at most"):
        C.load_claims(_text(tmp_path, "# " + "x" * C.MAX_CLAIMS_BYTES))
    path = tmp_path / "tiny.yaml"
    path.write_bytes(b"id: \xff\xfe\n")
    with pytest.raises(C.ClaimsFileError, match="not UTF-8"):
        C.load_claims(path)


# ---------------------------------------------------------------------------------------------- roles
@pytest.mark.parametrize("edit, field, expected", [
    (lambda d: d["claims"][0].pop("role"), r"claims\[0\]\.role", "headline | supporting | check"),
    (lambda d: d["claims"][0].update(role="main"), r"claims\[0\]\.role", "one of headline"),
    (lambda d: [c.update(role="supporting") for c in d["claims"] if c["role"] == "headline"], "claims",
     "1 to 3"),
    (lambda d: [c.update(role="headline", paper_value=None, paper_note="n", setting={"paper": "p", "ours": "o"})
                for c in d["claims"][1:]], "claims", "has 4 claims with 'role: headline'; expected 1 to 3"),
    (lambda d: d["claims"][1].update(seeds=5), r"claims\[1\]\.seeds", "a check is an exact, single-run"),
    (lambda d: d["claims"][0].pop("paper_value"), r"claims\[0\]\.paper_value", "location"),
    (lambda d: d["claims"][0].pop("paper_note"), r"claims\[0\]\.paper_note", "why the paper gives no number"),
    (lambda d: d["claims"][2].update(paper_value=1.0), r"claims\[2\]\.paper_value", "location in parentheses"),
    (lambda d: d["claims"][2].update(paper_value="qualitative (abstract)"), r"claims\[2\]\.paper_value",
     "location in parentheses"),
    (lambda d: d["claims"][2].update(paper_value="0.9 Table 2"), r"claims\[2\]\.paper_value", "in parentheses"),
    (lambda d: d["claims"][0].pop("setting"), r"claims\[0\]\.setting", "mapping"),
    (lambda d: d["claims"][0]["setting"].pop("ours"), r"claims\[0\]\.setting\.ours", "present"),
    (lambda d: d["claims"][0]["setting"].update(ours=" "), r"claims\[0\]\.setting\.ours", "data, model"),
    (lambda d: d.pop("implementation"), "implementation", "present"),
    (lambda d: d.update(implementation="ours"), "implementation", "paper | official-code | construct"),
    (lambda d: d.update(sources=[]), "sources", "non-empty list"),
    (lambda d: d.update(sources="the paper"), "sources", "a list of strings"),
    (lambda d: d.update(report=[{"id": "value_positive", "text": "t", "metric": "value"}]), r"report\[0\]\.id",
     "unique"),
    (lambda d: d.update(report=[{"id": "r", "text": "t", "metric": "final_acc"}]), r"report\[0\]\.range",
     "is missing"),
    (lambda d: d.update(report=[{"id": "r", "text": "t", "metric": "m", "expect": "> 0"}]), r"report\[0\]\.expect",
     "not a known field"),
])
def test_role_fields_are_validated(tmp_path, edit, field, expected):
    with pytest.raises(C.ClaimsFileError, match=rf"field '{field}'.*{expected}"):
        _load(tmp_path, edit)


def test_the_fixture_has_roles_a_report_row_and_a_construct_label(tmp_path):
    paper = _load(tmp_path, lambda d: d.update(implementation="construct", report=[
        {"id": "spread", "text": "the spread", "metric": "value", "note": "shown, not judged"}]))
    assert [c.role for c in paper.claims] == ["headline", "check", "headline", "supporting"]
    assert [c.id for c in paper.headlines] == ["value_positive", "value_large"] and paper.is_construct
    assert paper.report == (C.ReportRow(id="spread", text="the spread", metric="value", note="shown, not judged"),)
    assert C.report_values(paper, {"value": [1, 2]}) == [{"id": "spread", "text": "the spread", "metric": "value",
                                                          "note": "shown, not judged", "range": None, "ours": [1, 2]}]


# ---------------------------------------------------------------------------------------------- verdicts
def _rows(*pairs):
    return [{"id": f"c{i}", "role": role, "verdict": verdict} for i, (role, verdict) in enumerate(pairs)]


def test_the_paper_verdict_comes_from_its_headline_claims_alone():
    rows = _rows(("headline", C.NOT_REPRODUCED), ("check", C.REPRODUCED), ("check", C.REPRODUCED),
                 ("supporting", C.REPRODUCED))
    assert C.headline_verdict(rows) == C.NOT_REPRODUCED  # five checks and a supporting claim do not lift it
    assert C.headline_verdict(_rows(("headline", C.REPRODUCED), ("supporting", C.NOT_REPRODUCED))) == C.REPRODUCED
    assert C.headline_verdict(_rows(("headline", C.INCONCLUSIVE), ("headline", C.NOT_REPRODUCED))) == C.INCONCLUSIVE
    result = {"paper": "p", "scale": "smoke", "verdict": C.headline_verdict(rows), "claims": rows,
              "implementation": "construct", "report": [{"id": "r"}]}
    assert beside(result) == "supporting 1/1 reproduced; checks 2/2 hold; 1 reported"
    assert verdict_label(result) == "construct: not reproduced at this scale"
    assert headline_rows(result)[0][-2] == ("construct: not reproduced at this scale "
                                            "(supporting 1/1 reproduced; checks 2/2 hold; 1 reported)")
    lines = summary_lines([result, dict(result, paper="q", implementation="paper", verdict=C.REPRODUCED)])
    assert lines[0] == "1 papers, by headline verdict: 1 reproduced"
    assert lines[1].startswith("1 constructs") and lines[1].endswith("1 not reproduced at this scale")
    assert "4 checks of our code: 4 hold" in lines


def test_a_range_may_be_open_at_one_end(tmp_path):
    paper = _load(tmp_path, _bounded("> 0.9", span=(0, None), metric="norm_acc"))
    assert paper.claims[2].range == (0.0, float("inf"))
    with pytest.raises(C.ClaimsFileError, match="cannot fail"):
        _load(tmp_path, _bounded(">= 0", span=(0, None), metric="norm_acc"))
    with pytest.raises(C.ClaimsFileError, match=r"claims\[2\]\.range"):
        _load(tmp_path, _bounded("> 0", span=(None, None), metric="norm_acc"))


def test_a_seeded_claim_at_another_scale_is_judged_on_every_recorded_seed():
    claim = C.Claim(id="c", text="t", metric="gain", expect=parse_expectation("> 0"), partial=None, paper_value=None,
                    verdict=C.REPRODUCED, note=None, seeds=5)
    ten = {"gain": [0.1, 0.2, 0.15, 0.12, 0.11, 0.13, 0.2, 0.1, 0.14, 0.16]}
    verdict, reason, summary = C.judge_detail(claim, ten, scale="paper")
    assert verdict == C.REPRODUCED and summary["n"] == 10
    assert C.judge_detail(claim, ten)[0] == C.ERROR  # at smoke the count is the claims file's
    assert C.judge_detail(claim, {"gain": [0.1] * 3}, scale="paper")[0] == C.ERROR  # never fewer than 5
