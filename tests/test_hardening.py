"""Bugs found by trying to break the package (issue 10, section 2): each test fails on the code before its fix.

Covers the board (what it embeds, how it escapes), corrupt result files, the CLI's exit codes, deep
expectations, `run`'s own output folder, paper ids, partitioner / federate input checks, and Krum ties.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedlab_nb.cli import main
from fedlab_nb.data import partition as P
from fedlab_nb.repro import claims as C
from fedlab_nb.repro.expect import ExpectationError, parse_expectation
from fedlab_nb.repro.recording import METRICS_FILE, RUN_DIR_ENV
from fedlab_nb.repro.report import build_report
from fedlab_nb.repro.runner import reproduce
from fedlab_nb.methods.robustness.rules import _iterated_krum, _squared_distances, bulyan, krum, multi_krum

FIXTURE = Path(__file__).parent / "data" / "tinyroot"
PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture
def repo(tmp_path):
    """(root, CLI arguments, results folder) of a copy of the fixture repository."""
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    return root, ["--root", str(root), "--results", str(tmp_path / "results")], tmp_path / "results"


@pytest.fixture
def fake_papermill(monkeypatch):
    """Replace papermill's execution by what the tiny notebook does (no kernel: fast); returns the call list."""
    import papermill
    calls = []

    def execute(input_path, output_path, parameters=None, **_):
        params = {"value": 0.5, **(parameters or {})}
        run_dir = Path(os.environ[RUN_DIR_ENV])
        (run_dir / METRICS_FILE).write_text(json.dumps({"value": params["value"], "double": 2 * params["value"]}))
        (run_dir / "main.png").write_bytes(PNG + f"value={params['value']}".encode())  # differs per run
        shutil.copy(input_path, output_path)
        calls.append(dict(params))

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    return calls


def write_paper(root: Path, name: str, edit) -> None:
    """papers/<name>.yaml: the fixture's claims file with id `name`, changed by `edit`."""
    data = yaml.safe_load((FIXTURE / "papers" / "tiny.yaml").read_text())
    data["id"] = name
    edit(data)
    (root / "papers" / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def result_file(results: Path, **fields) -> Path:
    """A hand-written results/tiny-smoke.json (as a crafted or foreign file could be)."""
    claim = {"id": "c", "text": "t", "metric": "m", "expect": "> 0", "partial": None, "paper_value": None,
             "ours": 1.0, "verdict": "reproduced", "reason": None, "stored_verdict": "reproduced"}
    data = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "claims": [claim], "error": None,
            "notebook": "tiny-smoke.ipynb", "figures": [], **fields}
    results.mkdir(parents=True, exist_ok=True)
    path = results / "tiny-smoke.json"
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------------------------------------- Krum / Bulyan
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_krum_distance_matrix_is_exactly_symmetric(dtype):
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(int(torch.randint(4, 40, (1,), generator=g)), 57, generator=g, dtype=dtype) * 10 + 3
        d2 = _squared_distances(x)
        assert torch.equal(d2, d2.T) and not d2.diagonal().any() and (d2 >= 0).all()


def test_bulyan_tie_goes_to_the_lowest_index():
    """Hand-made tie: after four picks the remaining rows are {0, 3, 6} and Krum keeps one neighbour, so
    its score is the distance to the nearest row; rows 3 and 6 are each other's nearest, an exact tie."""
    x = torch.tensor([[-2.4, -4.0, -0.7, 1.3], [3.4, 0.3, -1.7, -2.4], [2.2, 4.9, 0.8, -3.7],
                      [-2.9, 4.8, 0.6, -5.2], [-0.3, -3.5, -1.9, -1.5], [-2.1, 1.7, -0.2, -1.8],
                      [1.2, 2.5, -4.9, -0.8]], dtype=torch.float64)
    assert _iterated_krum(x, 1, 5).tolist() == [1, 5, 4, 2, 3]
    agg = pytest.importorskip("flwr.server.strategy.aggregate")
    flower = agg.aggregate_bulyan([([r.numpy()], 1) for r in x], 1, agg.aggregate_krum, to_keep=0)[0]
    np.testing.assert_allclose(bulyan(x, f=1).numpy(), flower, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,f", [(7, 1), (9, 1), (11, 2)])
def test_krum_and_bulyan_ties_match_flower(n, f):
    """Bulyan's last Krum steps keep one neighbour: the closest pair always ties (Flower: lowest index)."""
    agg = pytest.importorskip("flwr.server.strategy.aggregate")
    for seed in range(60):
        x = torch.tensor(np.random.default_rng(seed).normal(size=(n, 4)))
        x[:f] += 20
        results = [([r.numpy()], 1) for r in x]
        flower = agg.aggregate_bulyan(list(results), f, agg.aggregate_krum, to_keep=0)[0]
        np.testing.assert_allclose(bulyan(x, f=f).numpy(), flower, rtol=0, atol=1e-12, err_msg=f"seed {seed}")
        np.testing.assert_allclose(krum(x, f=f).numpy(), agg.aggregate_krum(results, f, 0)[0], rtol=0, atol=0)
        np.testing.assert_allclose(multi_krum(x, f=f, m=n - f).numpy(), agg.aggregate_krum(results, f, n - f)[0],
                                   rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------- the board
def test_board_links_only_pngs_inside_the_results_folder(tmp_path):
    results, outside = tmp_path / "results", tmp_path / "outside"
    (results / "tiny-smoke").mkdir(parents=True)
    outside.mkdir()
    (results / "tiny-smoke" / "main.png").write_bytes(PNG + b"the real figure")
    (results / "tiny-smoke" / "fake.png").write_bytes(b"not an image: a secret")
    (outside / "secret.png").write_bytes(PNG + b"outside the results folder")
    (results / "tiny-smoke" / "link.png").symlink_to(outside / "secret.png")
    result_file(results, figures=["/etc/passwd", str(outside / "secret.png"), "../outside/secret.png", "a\x00.png",
                                  "tiny-smoke/link.png", "tiny-smoke/fake.png", "tiny-smoke/main.png"])
    text = build_report(results)
    page = (results / "index.html").read_text()
    linked = re.findall(r'<img [^>]*src="([^"]*)"', page)
    assert linked == ["tiny-smoke/main.png"] and "base64," not in page  # lazy links, nothing embedded
    assert "passwd" not in text and "secret" not in text and "link.png" not in text and "fake.png" not in text
    assert "![main](tiny-smoke/main.png)" in text


def test_report_md_escapes_text_as_the_html_does(tmp_path):
    results = tmp_path / "results"
    evil = "<script>alert(1)</script> [click](javascript:alert(1)) a|b"
    path = result_file(results, error={"cell": 1, "ename": "RuntimeError", "evalue": evil}, verdict="error",
                       method=evil)
    data = json.loads(path.read_text())
    data["claims"][0].update(verdict="error", reason=evil, paper_value=evil)
    path.write_text(json.dumps(data))
    text = build_report(results)
    page = (results / "index.html").read_text()
    assert "<script>" not in text and "<script>alert" not in page
    assert page.count("<script>") == 2  # the board's own filter script and its call, nothing from a result
    assert "&lt;script&gt;" in page and "&lt;script>" in text
    assert "[click]\\(javascript:" in text and not re.search(r"\]\(", text)  # no link
    assert "a\\|b" in text  # a table cell is never split


# ---------------------------------------------------------------------------------------------- corrupt results
def test_report_shows_a_corrupt_result_as_a_stale_row(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text('{"paper": "tiny", "claims": [')  # cut off mid-write
    (results / "other-smoke.json").write_text("[1, 2]")
    text = build_report(results)
    assert "| tiny | smoke | — | — | — | — | — | stale: corrupt result file |" in text
    assert "| other | smoke | — | — | — | — | — | stale: corrupt result file |" in text
    assert "tiny-smoke.json is not valid JSON" in text
    page = (results / "index.html").read_text()
    assert "<b>tiny</b> (smoke) — " in page and "stale: corrupt result file" in page


def test_list_warns_about_a_corrupt_result_and_goes_on(repo, capsys):
    _, args, results = repo
    results.mkdir()
    (results / "tiny-smoke.json").write_text("{not json")
    assert main(args + ["list"]) == 0
    captured = capsys.readouterr()
    assert f"warning: {results / 'tiny-smoke.json'} is not valid JSON" in captured.err
    assert "last: smoke: stale (corrupt result file)" in captured.out and "Traceback" not in captured.err


def test_reproduce_reruns_a_corrupt_result(repo, capsys, fake_papermill):
    _, args, results = repo
    results.mkdir()
    (results / "tiny-smoke.json").write_text("\x00\x01 garbage")
    assert main(args + ["reproduce", "tiny"]) == 0
    captured = capsys.readouterr()
    assert f"warning: {results / 'tiny-smoke.json'} is not valid JSON" in captured.err
    assert "treating it as stale" in captured.err and len(fake_papermill) == 1
    assert json.loads((results / "tiny-smoke.json").read_text())["verdict"] == C.PARTIAL


# ---------------------------------------------------------------------------------------------- CLI
def test_reproduce_all_goes_on_after_an_invalid_claims_file(repo, capsys, fake_papermill):
    root, args, results = repo
    (root / "papers" / "bad.yaml").write_text("id: bad\n")  # sorts before tiny
    assert main(args + ["reproduce", "--all"]) == 1
    captured = capsys.readouterr()
    assert "bad: error:" in captured.err and "field 'method' is missing" in captured.err
    assert "tiny (smoke): PARTIALLY REPRODUCED" in captured.out
    assert "1 of 2 papers could not be reproduced: bad" in captured.err
    assert (results / "tiny-smoke.json").is_file()


def test_reproduce_all_without_claims_files_is_an_error(tmp_path, capsys):
    (tmp_path / "empty" / "papers").mkdir(parents=True)
    assert main(["--root", str(tmp_path / "empty"), "reproduce", "--all"]) == 2
    assert "no claims files in" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["reproduce", "tiny", "--device", "gpu"], "'gpu' is not a device"),
    (["run", "tiny", "--device", "cuda0"], "'cuda0' is not a device"),
    (["reproduce", "--all", "--scale", "huge"], "no scale 'huge'"),
    (["run", "../papers/tiny"], "is not an identifier"),
    (["reproduce", "tiny/../tiny"], "is not an identifier"),
])
def test_usage_errors_exit_2_everywhere(repo, capsys, fake_papermill, argv, message):
    _, args, _ = repo
    try:
        code = main(args + argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    assert code == 2 and message in capsys.readouterr().err and not fake_papermill


# ---------------------------------------------------------------------------------------------- expectations
def test_deeply_nested_expectation_is_a_clear_error():
    with pytest.raises(ExpectationError, match=r"… \(10003 characters\) has 10002 tokens; at most 256"):
        parse_expectation("< " + "(" * 5000 + "1" + ")" * 5000)
    with pytest.raises(ExpectationError, match="nests parentheses / '-' more than 32 deep; simplify it"):
        parse_expectation("< " + "(" * 40 + "1" + ")" * 40)
    with pytest.raises(ExpectationError, match="more than 32 deep"):
        parse_expectation("> " + "-" * 100 + "1")
    with pytest.raises(ExpectationError, match="at most 256 are allowed"):
        parse_expectation("< " + " + ".join(["a"] * 3000))
    assert parse_expectation("< " + "(" * 30 + "1" + ")" * 30).holds(0.5, {})


def test_a_deep_expectation_does_not_break_list_for_other_papers(repo, capsys):
    root, args, _ = repo
    write_paper(root, "deep", lambda d: d["claims"][0].update(expect="< " + "(" * 5000 + "1" + ")" * 5000))
    assert main(args + ["list"]) == 1
    captured = capsys.readouterr()
    assert "deep: INVALID:" in captured.err and "claims[0].expect" in captured.err
    assert "tiny — " in captured.out


# ---------------------------------------------------------------------------------------------- run vs reproduce
def test_run_writes_to_its_own_folder(repo, capsys, fake_papermill):
    _, args, results = repo
    assert main(args + ["reproduce", "tiny"]) == 0
    board = {p: p.read_bytes() for p in (results / "tiny-smoke.ipynb", results / "tiny-smoke" / "main.png")}
    assert main(args + ["run", "tiny", "-p", "value", "20"]) == 0
    assert main(args + ["run", "tiny", "-p", "value", "30"]) == 0
    assert all(p.read_bytes() == content for p, content in board.items())  # reproduce's files untouched
    runs = sorted((results / "runs").iterdir())
    assert [p.name[:len("tiny-smoke-")] for p in runs] == ["tiny-smoke-"] * 2  # one folder per parameter set
    assert {(p / "tiny-smoke" / "main.png").read_bytes() for p in runs} == {PNG + b"value=20.0", PNG + b"value=30.0"}
    capsys.readouterr()
    assert main(args + ["reproduce", "tiny"]) == 0
    assert "[up to date]" in capsys.readouterr().out and len(fake_papermill) == 3


def test_reproduce_is_not_up_to_date_when_its_outputs_or_notebook_changed(repo, fake_papermill):
    root, _, results = repo
    reproduce("tiny", root=root, out_dir=results)
    assert reproduce("tiny", root=root, out_dir=results).get("skipped")
    (results / "tiny-smoke" / "main.png").write_bytes(PNG + b"another run's figure")
    again = reproduce("tiny", root=root, out_dir=results)
    assert not again.get("skipped") and (results / "tiny-smoke" / "main.png").read_bytes() == PNG + b"value=0.5"
    notebook = root / "notebooks" / "tiny.ipynb"
    notebook.write_text(notebook.read_text().replace("value = 0.5", "value = 0.6"))
    assert not reproduce("tiny", root=root, out_dir=results).get("skipped")
    assert len(fake_papermill) == 3


# ---------------------------------------------------------------------------------------------- paper ids
@pytest.mark.parametrize("bad", ["../papers/tiny", "tiny/../tiny", "/tmp/tiny", "ti-ny", "1tiny", "tiny\n", "",
                                 "tïny"])
def test_paper_ids_must_be_identifiers(repo, bad):
    root, _, _ = repo
    for call in (lambda: C.claims_path(bad, root), lambda: C.load_paper(bad, root),
                 lambda: reproduce(bad, root=root, out_dir=root / "r"), lambda: C.find_claims_file(bad)):
        with pytest.raises(C.PaperIdError, match="is not an identifier"):
            call()
    assert not (root / "r").exists()


def test_a_claims_file_name_must_be_an_identifier(repo):
    root, _, _ = repo
    write_paper(root, "my-paper", lambda d: None)
    with pytest.raises(C.ClaimsFileError, match="field 'id' is 'my-paper'; expected an identifier"):
        C.load_claims(root / "papers" / "my-paper.yaml")


# ---------------------------------------------------------------------------------------------- partitioners
LABELS = np.arange(1000) % 10


@pytest.mark.parametrize("call, match", [
    (lambda: P.quantity_skew(LABELS, 5, sigma=float("nan")), "sigma must be >= 0, a finite number, got nan"),
    (lambda: P.quantity_skew(LABELS, 5, kind="dirichlet", alpha=float("nan")), "alpha must be > 0, a finite"),
    (lambda: P.natural(LABELS, 0), "n_clients must be a positive integer, got 0"),
    (lambda: P.natural(LABELS, -1), "n_clients must be a positive integer, got -1"),
    (lambda: P.natural(np.where(LABELS == 3, np.nan, LABELS)), r"groups contain NaN or inf in 100 rows"),
    (lambda: P.iid(np.where(LABELS == 3, np.nan, LABELS), 5), r"labels contain NaN or inf in 100 rows \(first: \[3,"),
    (lambda: P.dirichlet(np.where(LABELS == 3, np.inf, LABELS), 5, 0.5), "labels contain NaN or inf"),
    (lambda: P.feature_skew(LABELS, 4, strength=float("nan")), "strength must be >= 0, a finite number"),
])
def test_partitioners_refuse_nan_and_non_positive_counts(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: P.dirichlet(LABELS, 10, alpha="0.1"), r"alpha must be > 0, a finite number, got '0.1' \(str\); e.g. alpha="),
    (lambda: P.pathological(LABELS, 10, classes_per_client="2"),
     r"classes_per_client must be a positive integer, got '2' \(str\); pass a whole number such as classes_per_client=2"),
    (lambda: P.pathological(LABELS, 10, classes_per_client=2.0), r"classes_per_client .* got 2.0 \(float\)"),
    (lambda: P.shards(LABELS, 10, shards_per_client=2.5), r"shards_per_client .* got 2.5 \(float\); pass a whole"),
    (lambda: P.shards(LABELS, 10, shards_per_client="2"), r"shards_per_client .* got '2' \(str\)"),
    (lambda: P.iid(LABELS, 3.0), r"n_clients must be a positive integer, got 3.0 \(float\); .* n_clients=10"),
    (lambda: P.iid(LABELS, "3"), r"n_clients .* got '3' \(str\)"),
])
def test_partitioner_messages_name_the_parameter_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------- federate
@pytest.fixture(scope="module")
def digits():
    from fedlab_nb.data.datasets import load_dataset
    return load_dataset("digits")


def _changed(ds, name, row, value):
    import dataclasses
    tensor = getattr(ds, name).clone()
    tensor.view(len(tensor), -1)[row, 0] = value
    return dataclasses.replace(ds, **{name: tensor})


@pytest.mark.parametrize("name, value, match", [
    ("y_train", 12, r"y_train has labels outside \[0, num_classes=10\) in 1 rows \(first: row 5, label 12\); "
                    "set num_classes to at least 13"),
    ("y_test", -1, r"y_test has labels outside \[0, num_classes=10\)"),
    ("x_train", float("nan"), r"x_train has NaN or inf in 1 rows \(first: \[5\]\); drop or impute"),
    ("x_test", float("inf"), r"x_test has NaN or inf in 1 rows"),
])
def test_federate_refuses_bad_labels_and_nonfinite_inputs(digits, name, value, match):
    import fedlab_nb as fl
    with pytest.raises(ValueError, match=match):
        fl.federate(_changed(digits, name, 5, value), "iid", n_clients=4)


def test_federate_messages_name_the_parameter_and_the_fix(digits):
    import fedlab_nb as fl
    with pytest.raises(ValueError, match=r"alpha must be > 0, a finite number, got '0.3' \(str\)"):
        fl.federate(digits, "dirichlet", n_clients=4, alpha="0.3")
    with pytest.raises(ValueError, match=r"n_clients must be a positive integer, got 4.0 \(float\)"):
        fl.federate(digits, "dirichlet", n_clients=4.0, alpha=0.3)
    with pytest.raises(ValueError, match=r"test_fraction must be a number in \[0, 1\), e.g. 0.2, got '0.2'"):
        fl.federate(digits, "iid", n_clients=4, test_fraction="0.2")
    other = P.iid(np.arange(5000) % 10, 4)  # built for another data set's labels
    with pytest.raises(ValueError, match="build the partition from this data set's labels"):
        fl.FederatedDataset(digits, other)
