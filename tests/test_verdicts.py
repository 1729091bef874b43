"""Verdicts over seeds: the t interval (against scipy), the three-way verdict, paired differences, partial,
claims-file validation of seeds / confidence, recording per-seed lists, and their display."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats
import torch

from fedlab_nb import repro
from fedlab_nb.repro import claims as C
from fedlab_nb.repro import recording as R
from fedlab_nb.repro import verdicts as V
from fedlab_nb.repro.expect import parse_expectation
from fedlab_nb.repro.report import COLOURS, build_report

from test_repro import FIXTURE, fixture_claims, write_claims

BASE = [0.60, 0.61, 0.62, 0.60, 0.59]  # mean 0.604, half-width ≈ 0.0078 at 90 %


def seeded(expect, partial=None, seeds=5, metric="acc", confidence=0.9):
    return C.Claim(id="c", text="t", metric=metric, expect=parse_expectation(expect),
                   partial=parse_expectation(partial) if partial else None, paper_value=None,
                   verdict=C.REPRODUCED, note=None, seeds=seeds, confidence=confidence)


# ---------------------------------------------------------------------------------------------- interval math
@pytest.mark.parametrize("confidence", [0.8, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("n", [5, 8, 20])
def test_interval_matches_scipy_t(n, confidence):
    x = np.random.default_rng(n).normal(0.7, 0.05, n)
    interval = V.mean_interval(x, confidence)
    # scipy's two-sided interval at 2c - 1 has the one-sided bounds at c as its ends
    low, high = scipy.stats.t.interval(2 * confidence - 1, n - 1, loc=x.mean(), scale=scipy.stats.sem(x))
    assert interval.low == pytest.approx(low, rel=1e-12) and interval.high == pytest.approx(high, rel=1e-12)
    assert interval.half_width == pytest.approx(scipy.stats.t.ppf(confidence, n - 1) * x.std(ddof=1) / math.sqrt(n))
    assert interval.n == n and interval.mean == pytest.approx(x.mean())


def test_one_sided_bound_is_a_one_sided_test():
    """m − h > 0 exactly when scipy's one-sided t test rejects mean <= 0 at level 1 − confidence."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.normal(rng.uniform(-0.05, 0.05), 0.05, 6)
        p = scipy.stats.ttest_1samp(x, 0.0, alternative="greater").pvalue
        assert (V.mean_interval(x, 0.9).low > 0) == (p < 0.1)


def test_interval_needs_two_values():
    with pytest.raises(ValueError, match="at least 2"):
        V.mean_interval([1.0])


# ---------------------------------------------------------------------------------------------- three-way verdict
@pytest.mark.parametrize("op, values, expected", [
    (">", [0.1, 0.12, 0.11, 0.1, 0.09], V.REPRODUCED),
    (">", [-0.1, -0.12, -0.11, -0.1, -0.09], V.NOT_REPRODUCED),
    (">", [0.1, -0.1, 0.05, -0.05, 0.01], V.INCONCLUSIVE),
    ("<", [-0.1, -0.12, -0.11, -0.1, -0.09], V.REPRODUCED),
    ("<", [0.1, 0.12, 0.11, 0.1, 0.09], V.NOT_REPRODUCED),
    ("<", [0.1, -0.1, 0.05, -0.05, 0.01], V.INCONCLUSIVE),
    (">", [0.0] * 5, V.NOT_REPRODUCED), (">=", [0.0] * 5, V.REPRODUCED),   # no spread: the mean decides
    ("<", [0.0] * 5, V.NOT_REPRODUCED), ("<=", [0.0] * 5, V.REPRODUCED),
])
def test_one_sided_verdict(op, values, expected):
    assert V.one_sided_verdict(V.mean_interval(values), op) == expected


def test_claim_verdicts_three_way():
    assert C.judge(seeded("> 0.59"), {"acc": BASE}) == (C.REPRODUCED, None)      # 0.604 − 0.0078 > 0.59
    assert C.judge(seeded("> 0.62"), {"acc": BASE}) == (C.NOT_REPRODUCED, None)  # 0.604 + 0.0078 < 0.62
    assert C.judge(seeded("> 0.60"), {"acc": BASE}) == (C.INCONCLUSIVE, None)    # straddles
    assert C.judge(seeded("< 0.62"), {"acc": BASE}) == (C.REPRODUCED, None)
    assert C.judge(seeded("< 0.60"), {"acc": BASE}) == (C.INCONCLUSIVE, None)


def test_confidence_widens_the_interval():
    assert C.judge(seeded("> 0.598", confidence=0.8), {"acc": BASE})[0] == C.REPRODUCED
    assert C.judge(seeded("> 0.598", confidence=0.99), {"acc": BASE})[0] == C.INCONCLUSIVE


def test_paired_difference_uses_the_same_seed():
    """Seed effects shared by both methods cancel: each seed's method beats FedAvg by ≈ 0.01."""
    shared = np.array([0.0, 0.2, -0.2, 0.1, -0.1])  # large seed-to-seed spread, the same for both methods
    fedavg = 0.7 + shared
    method = fedavg + np.array([0.011, 0.009, 0.010, 0.012, 0.008])
    metrics = {"acc": method.tolist(), "fedavg_acc": fedavg.tolist()}
    assert C.judge(seeded("> fedavg_acc"), metrics)[0] == C.REPRODUCED
    assert C.judge(seeded("> fedavg_acc + 0.02"), metrics)[0] == C.NOT_REPRODUCED
    # unpaired (shuffled order) the spread of the difference swamps the gain
    metrics["fedavg_acc"] = fedavg[[1, 2, 3, 4, 0]].tolist()
    assert C.judge(seeded("> fedavg_acc"), metrics)[0] == C.INCONCLUSIVE
    _, _, summary = C.judge_detail(seeded("> fedavg_acc"), {"acc": method.tolist(), "fedavg_acc": fedavg.tolist()})
    assert summary["margin"]["mean"] == pytest.approx(0.01) and summary["mean"] == pytest.approx(method.mean())


def test_scalars_broadcast_against_per_seed_values():
    assert C.judge(seeded("> base + 0.05"), {"acc": BASE, "base": 0.5})[0] == C.REPRODUCED
    assert C.judge(seeded("< 2 * base"), {"acc": BASE, "base": 0.29})[0] == C.NOT_REPRODUCED


def test_partial_over_seeds():
    assert C.judge(seeded("> 0.7", partial="> 0.59"), {"acc": BASE})[0] == C.PARTIAL
    assert C.judge(seeded("> 0.7", partial="> 0.60"), {"acc": BASE})[0] == C.INCONCLUSIVE
    assert C.judge(seeded("> 0.7", partial="> 0.65"), {"acc": BASE})[0] == C.NOT_REPRODUCED
    # an inconclusive expect is inconclusive even when partial holds: we cannot tell R from P
    assert C.judge(seeded("> 0.60", partial="> 0.5"), {"acc": BASE})[0] == C.INCONCLUSIVE


@pytest.mark.parametrize("expect, expected", [
    ("within 0.02 of 0.6", C.REPRODUCED), ("within 0.001 of 0.6", C.INCONCLUSIVE),
    ("within 0.01 of 0.7", C.NOT_REPRODUCED), ("within 5% of 0.6", C.REPRODUCED),
    ("between 0.5 and 0.7", C.REPRODUCED), ("between 0.6 and 0.7", C.INCONCLUSIVE),
    ("between 0.65 and 0.7", C.NOT_REPRODUCED), ("between 0.4 and 0.5", C.NOT_REPRODUCED),
])
def test_bands_over_seeds(expect, expected):
    assert C.judge(seeded(expect), {"acc": BASE})[0] == expected


@pytest.mark.parametrize("metrics, message", [
    ({}, "acc was not recorded"),
    ({"acc": 0.6}, "recorded as a single value"),
    ({"acc": BASE[:3]}, "has 3 per-seed values; the claim says seeds: 5"),
    ({"acc": [0.6, None, 0.6, 0.6, 0.6]}, "at seed index 1"),
])
def test_seeded_claim_errors_say_what_was_recorded(metrics, message):
    verdict, reason = C.judge(seeded("> 0.5"), metrics)
    assert verdict == C.ERROR and message in reason


def test_bound_with_wrong_length_or_type_is_an_error():
    verdict, reason = C.judge(seeded("> base"), {"acc": BASE, "base": [0.5] * 4})
    assert verdict == C.ERROR and "base has 4 per-seed values" in reason
    verdict, reason = C.judge(seeded("> base"), {"acc": BASE, "base": "x"})
    assert verdict == C.ERROR and "compares numbers" in reason
    verdict, reason = C.judge(seeded('> "high"'), {"acc": BASE})
    assert verdict == C.ERROR and "cannot evaluate the bound per seed" in reason


def test_unseeded_claim_refuses_a_per_seed_list():
    single = seeded("> 0.5", seeds=None)
    verdict, reason = C.judge(single, {"acc": BASE})
    assert verdict == C.ERROR and "add 'seeds: 5'" in reason
    verdict, reason = C.judge(seeded("> base", seeds=None), {"acc": 0.7, "base": BASE})
    assert verdict == C.ERROR and "metric base holds 5 per-seed values" in reason


def test_paper_verdict_with_inconclusive():
    R_, P, N, I, E = C.REPRODUCED, C.PARTIAL, C.NOT_REPRODUCED, C.INCONCLUSIVE, C.ERROR
    assert C.paper_verdict([R_, I]) == P
    assert C.paper_verdict([I, I]) == I
    assert C.paper_verdict([N, I]) == I
    assert C.paper_verdict([P, I]) == P
    assert C.paper_verdict([I, E]) == E
    assert C.paper_verdict([N, N]) == N


def test_claim_line_names_the_seed_count():
    assert C.claim_line(seeded("> 0.5"), C.INCONCLUSIVE) == "c (acc > 0.5, 5 seeds): INCONCLUSIVE AT THIS SCALE"


# ---------------------------------------------------------------------------------------------- claims files
def _seeded_file(**fields):
    data = fixture_claims()
    data["claims"][0].update(fields)
    return data


@pytest.mark.parametrize("fields, field, expected", [
    ({"seeds": 3}, "claims[0].seeds", "integer >= 5"),
    ({"seeds": "5"}, "claims[0].seeds", "integer >= 5"),
    ({"seeds": True}, "claims[0].seeds", "integer >= 5"),
    ({"seeds": 5.0}, "claims[0].seeds", "integer >= 5"),
    ({"seeds": 5, "confidence": 1.0}, "claims[0].confidence", "between 0.5 and 1"),
    ({"seeds": 5, "confidence": 0.4}, "claims[0].confidence", "between 0.5 and 1"),
    ({"seeds": 5, "confidence": "high"}, "claims[0].confidence", "between 0.5 and 1"),
    ({"confidence": 0.9}, "claims[0].confidence", "'seeds: N'"),
    ({"seeds": 5, "expect": "== 1"}, "claims[0].expect", "== cannot be judged over seeds"),
    ({"seeds": 5, "partial": "== 1"}, "claims[0].partial", "== cannot be judged over seeds"),
])
def test_seed_fields_are_validated(tmp_path, fields, field, expected):
    path = write_claims(tmp_path, _seeded_file(**fields))
    with pytest.raises(C.ClaimsFileError) as info:
        C.load_claims(path)
    assert str(path) in str(info.value) and f"'{field}'" in str(info.value) and expected in str(info.value)


def test_seed_fields_load(tmp_path):
    data = _seeded_file(seeds=6, confidence=0.95)
    data["claims"][1].update(seeds=5, role="supporting")  # a seeded claim is not a check
    data["claims"][3]["verdict"] = C.INCONCLUSIVE  # the new verdict may be stored (its note is required)
    paper = C.load_claims(write_claims(tmp_path, data))
    assert (paper.claims[0].seeds, paper.claims[0].confidence) == (6, 0.95)
    assert (paper.claims[1].seeds, paper.claims[1].confidence) == (5, 0.9)
    assert paper.claims[2].seeds is None and paper.claims[3].verdict == C.INCONCLUSIVE


@pytest.mark.parametrize("value", [{"rtol": -1}, {"tol": 0.1}, [0.1]])
def test_figure_tolerance_is_validated(tmp_path, value):
    data = fixture_claims()
    data["figure_tolerance"] = value
    with pytest.raises(C.ClaimsFileError, match="figure_tolerance"):
        C.load_claims(write_claims(tmp_path, data))


# ---------------------------------------------------------------------------------------------- recording
@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_metrics", {})
    monkeypatch.setenv(R.RUN_DIR_ENV, str(tmp_path / "run"))
    return tmp_path / "run"


def test_record_per_seed_sequences(run_dir):
    repro.record("a", [0.5, 1, float("nan")])
    repro.record("b", np.array([0.25, np.inf], dtype=np.float32))
    repro.record("c", torch.tensor([1.0, 2.0]))
    repro.record("d", (3, 4))
    repro.record("e", torch.tensor([0.5]))  # one element: a scalar, as before
    stored = json.loads((run_dir / "metrics.json").read_text())
    assert stored == {"a": [0.5, 1, None], "b": [0.25, None], "c": [1.0, 2.0], "d": [3, 4], "e": 0.5}


@pytest.mark.parametrize("value, message", [
    ([], "empty sequence"), (["x", 1], "needs numbers"), ([[1, 2]], "needs numbers"), ([True], "needs numbers"),
    (np.zeros((2, 3)), "1-D sequence"), (torch.zeros(2, 2), "1-D sequence"),
])
def test_record_refuses_bad_sequences(run_dir, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        repro.record("acc", value)


# ---------------------------------------------------------------------------------------------- display
def _result(claim_row: dict) -> dict:
    return {"paper": "p", "scale": "smoke", "verdict": claim_row["verdict"], "claims": [claim_row], "figures": []}


def _board(tmp_path, claim_row: dict) -> tuple[str, str]:
    (tmp_path / "p-smoke.json").write_text(json.dumps(_result(claim_row)))
    text = build_report(tmp_path)
    return text, (tmp_path / "index.html").read_text()


def test_board_shows_mean_interval_and_n(tmp_path):
    verdict, _, summary = C.judge_detail(seeded("> 0.6"), {"acc": BASE})
    assert V.summary_text(summary) == "0.604 ± 0.0078 (n=5, 90% one-sided)"
    row = {"id": "c", "expect": "> 0.6", "verdict": verdict, "ours": BASE, "interval": summary}
    text, page = _board(tmp_path, row)
    assert "| p | smoke | — | c | — | 0.604 ± 0.0078 (n=5, 90% one-sided) | > 0.6 | inconclusive at this scale |" in text
    assert "0.604 ± 0.0078 (n=5, 90% one-sided)" in page and "inconclusive at this scale" in page
    assert COLOURS[C.INCONCLUSIVE] in page
    _, _, paired = C.judge_detail(seeded("> b"), {"acc": BASE, "b": [0.58] * 5})
    assert "paired margin +0.024 ± 0.0078" in V.summary_text(paired)


def test_board_shows_raw_list_of_an_errored_seeded_claim(tmp_path):
    text, page = _board(tmp_path, {"id": "c", "expect": "> 0.6", "verdict": "error", "ours": BASE})
    assert "0.6, 0.61, 0.62, 0.6, 0.59" in text and "[0.6, 0.61, 0.62, 0.6, 0.59]" in page


def test_list_shows_interval(tmp_path, capsys):
    import shutil
    from fedlab_nb import cli
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    data = fixture_claims()
    data["claims"][0]["seeds"] = 5
    write_claims(root / "papers", data)
    _, _, summary = C.judge_detail(seeded("> 0"), {"acc": BASE})
    result = {"paper": "tiny", "scale": "smoke", "verdict": C.REPRODUCED,
              "claims": [{"id": "value_positive", "expect": "> 0", "verdict": C.REPRODUCED,
                          "interval": summary}]}
    (root / "results").mkdir()
    (root / "results" / "tiny-smoke.json").write_text(json.dumps(result))
    assert cli.main(["list", "--claims", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "headline value_positive (value > 0, 5 seeds): stored reproduced; last smoke: reproduced " \
           "[0.604 ± 0.0078 (n=5, 90% one-sided)]" in out
