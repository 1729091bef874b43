"""scripts/seed_audit.py: the table, the flip detection and the exit status, on fake results (no notebook runs)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fedlab_nb.repro import claims as C

from test_repro import make_root

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "seed_audit.py"
R, P, N, I, E = C.REPRODUCED, C.PARTIAL, C.NOT_REPRODUCED, C.INCONCLUSIVE, C.ERROR


@pytest.fixture(scope="module")
def audit():
    spec = importlib.util.spec_from_file_location("seed_audit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("verdicts, status", [
    ([R, R, R], "stable"), ([R, N, R], "flip"), ([N, I, R], "flip"), ([R, I, R], "inconclusive"),
    ([I, N, N], "inconclusive"), ([R, P, R], "partial"), ([P, N, P], "partial"), ([R, E, R], "error"),
])
def test_classify(audit, verdicts, status):
    assert audit.classify(verdicts) == status


FAKE = {"gas": {"never_worse": {"stored": R, 10: N, 20: R}, "rescues": {"stored": R, 10: I, 20: R}},
        "afl": {"invariance": {"stored": R, 10: R, 20: R}, "gain": {"stored": N, 10: P, 20: N}}}


def test_table_flags_flips_and_lists_moves(audit):
    rows = audit.audit_rows(FAKE, [10, 20])
    text = audit.table(rows, [10, 20])
    lines = text.splitlines()
    assert lines[0] == "| paper | claim | stored | seed 10 | seed 20 | status |"
    assert "| afl | invariance | R | R | R |  |" in lines
    assert "| afl | gain | N | P | N | partial |" in lines
    assert "| gas | never_worse | R | N | R | **FLIP** |" in lines
    assert "| gas | rescues | R | I | R | inconclusive |" in lines
    assert audit.summary(rows) == {"stable": ["afl/invariance"], "partial": ["afl/gain"],
                                   "flip": ["gas/never_worse"], "inconclusive": ["gas/rescues"]}
    assert audit.exit_status(rows) == 1


def test_exit_status(audit):
    calm = {"p": {"a": {"stored": R, 10: I}, "b": {"stored": P, 10: N}}}
    rows = audit.audit_rows(calm, [10])
    assert audit.exit_status(rows) == 0 and audit.exit_status(rows, strict=True) == 1
    assert audit.exit_status(audit.audit_rows({"p": {"a": {"stored": R}}}, [10])) == 1  # missing run = error


def test_main_runs_each_offset_into_its_own_folder(audit, tmp_path, monkeypatch, capsys):
    root = make_root(tmp_path)
    calls = []

    def fake_run(paper_id, scale, offset, out_dir, root_):
        calls.append((paper_id, scale, offset, Path(out_dir)))
        verdict = R if offset == 10 else N
        return paper_id, offset, {c.id: verdict for c in C.load_paper(paper_id, Path(root_)).claims}

    monkeypatch.setattr(audit, "run_one", fake_run)
    md = tmp_path / "audit.md"
    status = audit.main(["--papers", "tiny", "--offsets", "10", "20", "--root", str(root),
                         "--out", str(tmp_path / "audit"), "--markdown", str(md)])
    assert status == 1 and [c[2] for c in calls] == [10, 20]
    assert all(c[3] == tmp_path / "audit" for c in calls)
    out = capsys.readouterr().out
    assert "| tiny | value_positive | R | R | N | **FLIP** |" in out
    assert "flips (reproduced <-> not reproduced): 4" in out and md.read_text() in out + "\n"
    assert (tmp_path / "audit" / "audit.json").is_file()


def test_main_refuses_the_board_folder(audit, tmp_path):
    root = make_root(tmp_path)
    with pytest.raises(SystemExit) as info:
        audit.main(["--all", "--offsets", "10", "--root", str(root), "--out", str(root / "results")])
    assert info.value.code == 2
