"""Paper scale: the feasibility table is current, every stored paper-scale result belongs to its claims file
and notebook as they are now, and the board shows it beside the smoke verdict (scripts/paper_scale.py)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fedlab_nb.repro import claims as C
from fedlab_nb.repro.report import build_report
from fedlab_nb.repro.runner import build_parameters, content_hash

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("paper_scale", ROOT / "scripts" / "paper_scale.py")
paper_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paper_scale)
STORED = sorted((ROOT / "papers" / "paper_scale").glob("*.json"))


def test_the_feasibility_table_is_current():
    assert (ROOT / "docs" / "paper_scale.md").read_text() == paper_scale.table(), \
        "docs/paper_scale.md is out of date: run scripts/paper_scale.py"


def test_the_table_covers_every_paper():
    text = paper_scale.table()
    assert all(f"| `{pid}` |" in text for pid in C.paper_ids(ROOT))


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.stem)
def test_a_stored_paper_scale_result_matches_its_claims_file_and_notebook(path):
    """The stored run was made from today's claims file and notebook with the paper scale's parameters (the
    content hash `reproduce` uses to skip an up-to-date run), on the CPU, and gave the verdicts it stores."""
    stored = json.loads(path.read_text())
    paper = C.load_paper(path.stem, ROOT)
    assert paper.paper_scale and paper.paper_scale["status"] == "runs here"
    params, _ = build_parameters(paper, "paper", None, None)
    assert stored["scale"] == "paper" and stored["parameters"] == json.loads(json.dumps(params, default=str))
    assert stored["hash"] == content_hash(paper, params), \
        f"{path.name} is stale: run `fedlab-nb reproduce {path.stem} --scale paper` and scripts/paper_scale.py store"
    assert stored["error"] is None and {c["id"] for c in stored["claims"]} == {c.id for c in paper.claims}
    for name in stored["figures"]:
        assert (path.parent / name).is_file()


def test_the_board_shows_the_stored_paper_scale_beside_smoke(tmp_path):
    root = tmp_path / "root"
    (root / "papers" / "paper_scale").mkdir(parents=True)
    claim = {"id": "c", "role": "headline", "expect": "> 0", "verdict": C.NOT_REPRODUCED, "ours": 0.42,
             "paper_value": "0.91 (Table 2)"}
    stored = {"paper": "p", "scale": "paper", "verdict": C.NOT_REPRODUCED, "claims": [claim]}
    (root / "papers" / "paper_scale" / "p.json").write_text(json.dumps(stored))
    results = tmp_path / "results"
    results.mkdir()
    smoke = {"paper": "p", "scale": "smoke", "verdict": C.REPRODUCED, "claims": [dict(claim, verdict=C.REPRODUCED)]}
    (results / "p-smoke.json").write_text(json.dumps(smoke))
    text = build_report(results, root)
    assert "| not reproduced at this scale (c: ours 0.42 vs paper 0.91 (Table 2)) |" in text
    assert "ours 0.42 vs paper 0.91 (Table 2)" in (results / "index.html").read_text()


@pytest.mark.notebook
def test_reproduce_all_at_paper_scale_runs_only_what_runs_here(tmp_path, capsys):
    import shutil
    import yaml
    from fedlab_nb.cli import main
    root, results = tmp_path / "root", tmp_path / "results"
    shutil.copytree(ROOT / "tests" / "data" / "tinyroot", root)
    args = ["--root", str(root), "--results", str(results), "reproduce", "--all", "--scale", "paper", "-j", "1"]
    assert main(args) == 0
    assert "tiny (paper): SKIPPED — not assessed (docs/paper_scale.md)" in capsys.readouterr().out
    data = yaml.safe_load((root / "papers" / "tiny.yaml").read_text())
    data["paper_scale"] = {"setting": "the value 2", "data": "none", "status": "runs here"}
    (root / "papers" / "tiny.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    main(args)
    out = capsys.readouterr().out
    assert "tiny (paper): " in out and "SKIPPED" not in out
    result = json.loads((results / "tiny-paper.json").read_text())
    assert result["parameters"]["value"] == 2.0 and "cores" in result["cpu"]


def test_a_stand_in_is_never_named_paper(tmp_path):
    """Issue 41 item 4: where the paper's own setting does not run here, a stand-in scale is `paper-substitute`."""
    import shutil
    import yaml
    from fedlab_nb.repro.claims import ClaimsFileError, load_paper
    root = tmp_path / "root"
    shutil.copytree(ROOT / "tests" / "data" / "tinyroot", root)
    path = root / "papers" / "tiny.yaml"
    data = yaml.safe_load(path.read_text())
    stand_in = {"device": "cpu", "parameters": {"value": 2}}
    for status in ("needs data", "no experiment"):
        data["paper_scale"] = {"setting": "CIFAR-10", "data": "not offline", "status": status}
        data["scales"] = {"smoke": data["scales"]["smoke"], "paper": stand_in}
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        with pytest.raises(ClaimsFileError, match="name the stand-in 'paper-substitute'"):
            load_paper("tiny", root)
        data["scales"] = {"smoke": data["scales"]["smoke"], "paper-substitute": stand_in}
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert "paper-substitute" in load_paper("tiny", root).scales


def test_no_claims_file_passes_a_stand_in_off_as_the_paper():
    from fedlab_nb.repro.claims import load_paper, paper_ids
    for pid in paper_ids(ROOT):
        paper = load_paper(pid, ROOT)
        if "paper" in paper.scales:
            assert paper.paper_scale["status"] in ("runs here", "needs a GPU"), pid


def test_paper_sized_names_claims_of_the_file_and_marks_the_rest_smoke_sized(tmp_path):
    """`paper_scale.paper_sized`: the claims that run at the paper's own size; a paper-scale result whose headline
    claims are all outside it says its verdict is the smoke-sized headline's (board and table)."""
    import shutil
    import yaml
    from fedlab_nb.repro.claims import ClaimsFileError, load_paper
    from fedlab_nb.repro.report import paper_scale_label, paper_scale_text
    root = tmp_path / "root"
    shutil.copytree(ROOT / "tests" / "data" / "tinyroot", root)
    path = root / "papers" / "tiny.yaml"
    data = yaml.safe_load(path.read_text())
    ids = [c["id"] for c in data["claims"]]
    base = {"setting": "the value 2", "data": "none", "status": "needs a GPU"}
    for bad, match in (([], "non-empty list"), ("x", "non-empty list"), ([3], "non-empty list"),
                       (["nope"], "names 'nope' \\(no such claim\\)"), ([ids[0], ids[0]], "twice")):
        data["paper_scale"] = {**base, "paper_sized": bad}
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        with pytest.raises(ClaimsFileError, match=f"paper_scale.paper_sized.*{match}"):
            load_paper("tiny", root)
    data["paper_scale"] = {**base, "paper_sized": ids[:1]}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_paper("tiny", root).paper_scale["paper_sized"] == ids[:1]

    head = {"id": "h", "role": "headline", "expect": "> 0", "verdict": C.REPRODUCED, "ours": 1.0, "paper_value": None}
    sized = {"verdict": C.REPRODUCED, "claims": [dict(head, at_paper_size=True)]}
    smoke = {"verdict": C.REPRODUCED, "claims": [dict(head, at_paper_size=False),
                                                 dict(head, id="s", role="check", at_paper_size=True)]}
    older = {"verdict": C.REPRODUCED, "claims": [head]}  # stored before the field: every claim was paper-sized
    assert paper_scale_label(sized) == paper_scale_label(older) == C.REPRODUCED
    assert paper_scale_label(smoke) == f"{C.REPRODUCED} — headline claims at smoke size"
    assert "h [smoke size]: ours" in paper_scale_text({"paper_scale_result": smoke})
    assert "at the paper's size: s" in paper_scale._result_text(smoke)
    assert "at the paper's size" not in paper_scale._result_text(older)


def _numbers(metrics: dict) -> dict:
    """The metrics that are plain numbers or lists of them (what a re-run must give again)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, list)) and not isinstance(v, bool)}


@pytest.mark.notebook
@pytest.mark.parametrize("paper_id", ["aggregate_responses", "locational_dp"])   # the two quickest (~20 s, ~50 s)
def test_a_paper_scale_rerun_from_this_checkout_gives_the_stored_numbers(paper_id, tmp_path):
    """`reproduce ID --scale paper` here gives the stored result again: every claim's verdict, and on the CPU that
    stored it (same model name and kernel level) every number bit for bit; on another CPU, float rounding may
    differ, so only the verdicts are held to."""
    from fedlab_nb.cli import main
    from fedlab_nb.repro.runner import cpu_name
    stored = json.loads((ROOT / "papers" / "paper_scale" / f"{paper_id}.json").read_text())
    main(["--results", str(tmp_path), "reproduce", paper_id, "--scale", "paper", "--force", "-j", "1"])
    again = json.loads((tmp_path / f"{paper_id}-paper.json").read_text())
    assert again["error"] is None and again["hash"] == stored["hash"]
    assert {c["id"]: c["verdict"] for c in again["claims"]} == {c["id"]: c["verdict"] for c in stored["claims"]}
    if cpu_name() == stored["cpu"]:
        assert _numbers(again["metrics"]) == _numbers(stored["metrics"])
