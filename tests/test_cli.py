"""`fedlab-nb` command line: exit codes, one-line errors, and the list / run / reproduce / report / data
commands on a temporary copy of the fixture repository (tests/data/tinyroot)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedlab_nb.cli import main

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "tinyroot"


def make_root(tmp_path: Path, edit=None) -> Path:
    """A copy of the fixture repository (papers/ + notebooks/); `edit` may change the claims dict."""
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root)
    if edit is not None:
        add_paper(root, "tiny", edit)
    return root


def add_paper(root: Path, name: str, edit) -> None:
    """Write papers/<name>.yaml: the fixture's claims file changed by `edit`."""
    data = yaml.safe_load((FIXTURE / "papers" / "tiny.yaml").read_text())
    data["id"] = name
    edit(data)
    (root / "papers" / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture
def repo(tmp_path):
    root = make_root(tmp_path)
    return root, ["--root", str(root), "--results", str(tmp_path / "results")], tmp_path / "results"


def test_list_shows_papers_and_claims(repo, capsys):
    _, args, _ = repo
    assert main(args + ["list"]) == 0
    short = capsys.readouterr().out
    assert "tiny — Tiny — harness fixture: partially reproduced (supporting 0/1 reproduced; checks 1/1 hold; " \
           "last: not run yet)" in short
    assert "value_large" not in short  # one line per paper by default
    assert main(args + ["list", "--claims"]) == 0
    out = capsys.readouterr().out
    assert "  headline value_large (value > 0.9): stored partially reproduced" in out
    assert "      paper's number: 1.0 (Eq. 2)\n      setting: paper the value 1 / ours the value 0.5" in out
    assert out.index("headline value_large") < out.index("supporting value_huge") < out.index("check double_is")
    assert main(["list", "--claims", *args]) == 0  # --root / --results also accepted after the command
    assert capsys.readouterr().out == out
    assert main(args + ["list", "--role", "check"]) == 0
    checks = capsys.readouterr().out
    assert "check double_is_twice" in checks and "value_large" not in checks
    assert main(args + ["list", "--verdict", "not reproduced"]) == 0
    assert "tiny" not in capsys.readouterr().out  # its headline verdict is partially reproduced


def test_list_reports_invalid_claims_file(repo, capsys):
    root, args, _ = repo
    (root / "papers" / "bad.yaml").write_text("id: bad\n")
    assert main(args + ["list"]) == 1
    captured = capsys.readouterr()
    assert "bad: INVALID:" in captured.err and "field 'method' is missing" in captured.err
    assert "tiny — " in captured.out  # the valid paper is still listed


@pytest.mark.parametrize("argv, message", [
    (["reproduce"], "give paper ids or --all"),
    (["reproduce", "tiny", "--all"], "give paper ids or --all"),
    (["reproduce", "tinny"], "did you mean tiny?"),
    (["run", "tiny", "-p", "alpha", "0.1"], "unknown parameter 'alpha'"),
    (["run", "tiny", "-p", "n_points", "2.5"], "got float 2.5"),
    (["run", "tiny", "--scale", "huge"], "no scale 'huge'"),
])
def test_usage_errors_are_one_line_exit_2(repo, capsys, argv, message):
    _, args, results = repo
    assert main(args + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not results.exists()


@pytest.mark.notebook
def test_run_with_parameters(repo, capsys):
    _, args, results = repo
    assert main(args + ["run", "tiny", "-p", "value", "20", "-p", "n_points", "2", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "value = 20" in out and "double = 40" in out  # rounded for reading (4 significant digits)
    assert "value_huge (value >= 10): REPRODUCED" in out
    # `run` has its own folder: it never overwrites what `reproduce` wrote (and the board embeds)
    [folder] = (results / "runs").iterdir()
    assert (folder / "tiny-smoke.ipynb").is_file() and (folder / "tiny-smoke" / "main.png").is_file()
    assert not (results / "tiny-smoke.ipynb").exists() and not (results / "tiny-smoke.json").exists()
    # a readable folder name (the given parameters first), with parameters.json beside the executed notebook
    assert re.fullmatch(r"tiny-smoke-value=20.0_n_points=2_device=cpu-[0-9a-f]{8}", folder.name)
    saved = json.loads((folder / "parameters.json").read_text())
    assert saved["command"] == "fedlab-nb run tiny --scale smoke -p value 20 -p n_points 2 --device cpu"
    assert saved["parameters"] == {"n_points": 2, "value": 20.0, "scale": "smoke", "device": "cpu"}
    assert saved["effective"] == {"scale": "smoke", "seed": 0, "device": "cpu", "value": 20.0, "n_points": 2,
                                  "fail": False}
    assert saved["given"] == {"value": 20, "n_points": 2} and saved["scale_parameters"] == {"n_points": 4}
    assert f"run folder: {folder} (parameters.json" in out
    # progress when stderr is not a terminal: a start line, then one plain line per code cell
    err = captured.err
    assert err.splitlines()[0] == f"tiny (smoke): running notebooks/tiny.ipynb into {folder}"
    assert re.findall(r"tiny: cell (\d+) of 4 \(\d+ s elapsed\)", err) == ["1", "2", "3", "4"]


@pytest.mark.notebook
def test_reproduce_all_report_and_list(repo, capsys):
    root, args, results = repo
    add_paper(root, "broken", lambda d: d["scales"]["smoke"].update(parameters={"fail": True}))
    assert main(args + ["reproduce", "--all"]) == 1  # broken fails; tiny is still reproduced
    captured = capsys.readouterr()
    assert "tiny (smoke): PARTIALLY REPRODUCED" in captured.out
    assert "broken (smoke): ERROR" in captured.out and "RuntimeError: asked to fail" in captured.err
    assert json.loads((results / "tiny-smoke.json").read_text())["verdict"] == "partially reproduced"
    assert json.loads((results / "broken-smoke.json").read_text())["verdict"] == "error"

    assert main(args + ["reproduce", "tiny"]) == 0
    assert "[up to date]" in capsys.readouterr().out

    assert main(args + ["report"]) == 0
    printed = capsys.readouterr().out
    assert "2 papers, by headline verdict: " in printed and "1 partially reproduced" in printed
    assert "index.html" in printed
    out = (results / "REPORT.md").read_text()  # the terminal gets the summary, the file the whole table
    assert "| Paper | Scale | Role | Claim | Paper's number | Ours | Expectation | Verdict |" in out
    assert "| tiny | smoke | headline | value_positive | none: a fixture: there is no paper | 0.5 | > 0 | reproduced |" \
        in out
    assert (results / "index.html").is_file() and (results / "REPORT.md").is_file()

    assert main(args + ["list"]) == 0
    assert "tiny — Tiny — harness fixture: partially reproduced (supporting 0/1 reproduced; checks 1/1 hold; " \
           "last: smoke: partially reproduced)" in capsys.readouterr().out


@pytest.mark.notebook
def test_reproduce_fails_when_a_claim_differs_from_its_stored_verdict(tmp_path, capsys):
    def falsify(data):
        data["claims"][1]["expect"] = "within 1e-9 of 3 * value"  # false: double is 2 * value
    root = make_root(tmp_path, falsify)
    assert main(["--root", str(root), "--results", str(tmp_path / "results"), "reproduce", "tiny"]) == 1
    assert "MISMATCH double_is_twice: got 'not reproduced at this scale'" in capsys.readouterr().err


def test_data_lists_datasets(capsys):
    pytest.importorskip("fedlab_nb.data.datasets")
    assert main(["data"]) == 0
    assert "available" in capsys.readouterr().out


def test_data_fetch_unknown_name_is_a_usage_error(capsys):
    pytest.importorskip("fedlab_nb.data.fetch")
    assert main(["data", "fetch", "digits"]) == 2  # ships with scikit-learn: nothing to download
    assert "nothing to fetch for 'digits'" in capsys.readouterr().err


def test_module_entry_point():
    run = subprocess.run([sys.executable, "-m", "fedlab_nb.cli", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert run.returncode == 0 and "reproduce" in run.stdout
    run = subprocess.run([sys.executable, "-m", "fedlab_nb.cli", "frobnicate"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_parameter_values_are_yaml():
    from fedlab_nb.cli import _parse_parameters
    assert _parse_parameters([["alpha", "0.1"], ["n", "3"], ["iid", "true"], ["name", "digits"],
                              ["sizes", "[1, 2]"]]) == {"alpha": 0.1, "n": 3, "iid": True, "name": "digits",
                                                        "sizes": [1, 2]}
    assert yaml.safe_load("0.1") == 0.1


def test_reproduce_all_skips_papers_whose_extra_is_missing(repo, capsys):
    root, args, results = repo
    (root / "papers" / "tiny.yaml").unlink()
    add_paper(root, "needs_extra", lambda d: d.update(requires=["no_such_module_for_fedlab_nb"]))
    assert main(args + ["reproduce", "--all"]) == 0  # a missing optional extra is not a failed reproduction
    assert "needs_extra (smoke): SKIPPED — needs no_such_module_for_fedlab_nb" in capsys.readouterr().out
    assert not (results / "needs_extra-smoke.json").exists()


@pytest.mark.notebook
def test_reproduce_in_parallel_gives_the_serial_verdicts(repo, capsys):
    root, args, results = repo
    add_paper(root, "tiny2", lambda d: None)
    assert main(args + ["reproduce", "--all", "-j", "1"]) == 0
    serial = {p: json.loads((results / f"{p}-smoke.json").read_text()) for p in ("tiny", "tiny2")}
    capsys.readouterr()
    assert main(args + ["reproduce", "--all", "--force", "-j", "2"]) == 0
    captured = capsys.readouterr()
    for p in ("tiny", "tiny2"):
        parallel = json.loads((results / f"{p}-smoke.json").read_text())
        assert [c["verdict"] for c in parallel["claims"]] == [c["verdict"] for c in serial[p]["claims"]]
        assert f"{p} (smoke): PARTIALLY REPRODUCED" in captured.out
    assert "2 notebooks in" in captured.err and "(2 at a time)" in captured.err
    assert main(args + ["reproduce", "--all", "-j", "0"]) == 2
    assert "-j/--jobs must be >= 1" in capsys.readouterr().err


def test_history_shows_final_accuracy_and_privacy(tmp_path, capsys):
    from fedlab_nb.core.history import History
    rows = [{"round": r, "n_sampled": 3, "train_loss": 1.0, "test_acc": 0.5 + r / 10, "bytes_up": 10, "bytes_down": 20,
             "epsilon": 0.4 * r, "dp_delta": 1e-5} for r in (1, 2)]
    History.from_rows(rows, {"method": "dp_fedavg", "dataset": "digits", "seed": 0}).save(tmp_path / "dp.csv")
    assert main(["history", str(tmp_path / "dp.csv")]) == 0
    out = capsys.readouterr().out
    assert "final test_acc = 0.7000" in out and "privacy: (epsilon = 0.8, delta = 1e-05) after 2 rounds" in out
    assert main(["history", str(tmp_path / "dp.json")]) == 2
    assert "is not a History CSV file" in capsys.readouterr().err


def test_lab_works_on_copies_of_the_notebooks(repo, capsys):
    root, args, results = repo
    assert main(args + ["lab", "--dry-run"]) == 0
    copy = results / "lab" / "tiny.ipynb"
    assert copy.read_bytes() == (root / "notebooks" / "tiny.ipynb").read_bytes()
    assert f"--ServerApp.root_dir={results / 'lab'}" in capsys.readouterr().out
    copy.write_text("{}")  # the user's changes survive a second start, --fresh replaces them
    assert main(args + ["lab", "--dry-run"]) == 0 and copy.read_text() == "{}"
    assert main(args + ["lab", "--dry-run", "--fresh"]) == 0 and copy.read_text() != "{}"


@pytest.mark.notebook
def test_kernel_process_messages_go_to_a_log_not_the_terminal(tmp_path, capfd):
    import nbformat
    root = make_root(tmp_path)
    path = root / "notebooks" / "tiny.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import os; os.write(2, b'KERNEL-PROCESS-STDERR\\n')"))
    nbformat.write(nb, str(path))
    assert main(["--root", str(root), "--results", str(tmp_path / "results"), "reproduce", "tiny"]) == 0
    captured = capfd.readouterr()
    assert "KERNEL-PROCESS-STDERR" not in captured.err + captured.out
    assert "running over TCP" not in captured.err
    assert "KERNEL-PROCESS-STDERR" in (tmp_path / "results" / "tiny-smoke.kernel.log").read_text()


# ---------------------------------------------------------------------------------------------- run: params, folder, progress
def test_params_lists_the_notebook_parameters_and_the_scales(repo, capsys):
    _, args, _ = repo
    assert main(args + ["params", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny — Tiny — harness fixture: notebooks/tiny.ipynb, cell tagged `parameters`" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[1:7]}
    assert rows == {"scale": ["str", '"smoke"'], "seed": ["int", "0"], "device": ["str", '"cpu"'],
                    "value": ["float", "0.5"], "n_points": ["int", "3"], "fail": ["bool", "False"]}
    assert "  smoke: n_points=4; device cpu; about 10 s" in out and "  paper: value=2.0; device cpu" in out
    assert "e.g. fedlab-nb run tiny -p value 0.5" in out
    assert main(args + ["params", "tinny"]) == 2
    assert "did you mean tiny?" in capsys.readouterr().err


def test_parameter_table_reads_comments_annotations_and_long_defaults(tmp_path):
    import nbformat
    from fedlab_nb.repro.runner import parameter_table
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell('lr = 0.1  # the step size\nname: str = None\nsizes = [\n  1,  # one\n  2,\n]\n'
                                     'big = list(range(3))\nlong = "' + "x" * 80 + '"')
    cell.metadata["tags"] = ["parameters"]
    nb.cells.append(cell)
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    rows = {r["name"]: r for r in parameter_table(tmp_path / "nb.ipynb")}
    assert (rows["lr"]["type"], rows["lr"]["default"], rows["lr"]["comment"]) == ("float", "0.1", "the step size")
    assert (rows["name"]["type"], rows["name"]["default"]) == ("str", "None")
    assert (rows["sizes"]["type"], rows["sizes"]["default"]) == ("list", "[1, 2]")
    assert (rows["big"]["type"], rows["big"]["default"]) == ("any", "list(range(3))")
    assert len(rows["long"]["default"]) == 48 and rows["long"]["default"].endswith("...")


def test_run_help_points_to_params(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "fedlab-nb params ID" in out and "parameters.json" in out


def test_unknown_parameter_is_refused_before_running_with_the_valid_names(repo, capsys):
    _, args, results = repo
    assert main(args + ["run", "tiny", "-p", "valu", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'valu' for tiny.ipynb (did you mean 'value'?); " \
           "valid: device, fail, n_points, scale, seed, value" in err
    assert not results.exists()  # nothing ran


def test_run_folder_names_are_readable_safe_and_clipped():
    from fedlab_nb.repro.runner import FOLDER_LENGTH, run_folder
    folder = run_folder("tiny", "smoke", {"scale": "smoke", "n_points": 4, "value": 20}, "/r", first=["value"])
    assert folder.parent == Path("/r/runs")
    assert re.fullmatch(r"tiny-smoke-value=20_n_points=4-[0-9a-f]{8}", folder.name)
    odd = run_folder("tiny", "paper", {"path": "/tmp/a b", "sizes": [1, 2], "iid": True, "eps": 1e-05,
                                       "name": None, "text": "ü!"}, "/r")
    assert re.fullmatch(r"tiny-paper-eps=1e-05_iid=true_name=null_path=tmp-a-b_sizes=1-2_text=--[0-9a-f]{8}",
                        odd.name), odd.name
    long = run_folder("tiny", "smoke", {f"parameter_{i}": "x" * 30 for i in range(20)}, "/r")
    assert len(long.name) <= FOLDER_LENGTH and re.fullmatch(r"[A-Za-z0-9_.=-]+-[0-9a-f]{8}", long.name)
    assert run_folder("tiny", "smoke", {}, "/r").name.startswith("tiny-smoke-defaults-")
    assert run_folder("tiny", "smoke", {"value": 1}, "/r") != run_folder("tiny", "smoke", {"value": 2}, "/r")


def test_failed_run_without_an_executed_notebook_prints_no_notebook_path(repo, capsys, monkeypatch):
    import papermill
    _, args, results = repo

    def kernel_dies(*_, **__):
        raise RuntimeError("Kernel died before replying to kernel_info")
    monkeypatch.setattr(papermill, "execute_notebook", kernel_dies)
    assert main(args + ["run", "tiny", "-p", "value", "2"]) == 1
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith(("error", "no executed", "the executed"))]
    assert err[0].startswith("error: notebook failed after ")
    assert err[0].endswith("s: RuntimeError: Kernel died before replying to kernel_info")
    assert err[1].startswith("no executed notebook was written")
    assert not re.search(r"runs/\S*\.ipynb", captured.out + captured.err)  # no path that does not exist
    [folder] = (results / "runs").iterdir()
    assert not list(folder.glob("*.ipynb")) and (folder / "parameters.json").is_file()


@pytest.mark.notebook
def test_failed_run_prints_the_error_first(repo, capsys):
    _, args, results = repo
    assert main(args + ["run", "tiny", "-p", "fail", "true"]) == 1
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if not line.startswith("tiny")]  # progress lines aside
    assert re.fullmatch(r"error: notebook failed in cell \d+ after [\d.]+ s: RuntimeError: asked to fail", err[0])
    notebook = Path(err[1].removeprefix("the executed notebook, with the traceback: "))
    assert notebook.is_file() and "asked to fail" in notebook.read_text()
    assert "executed notebook:" not in captured.out and "REPRODUCED" not in captured.out


def test_lab_student_opens_the_student_versions(repo, capsys):
    """The course view: `lab --student` writes the student versions to results/lab/student/ and opens that folder."""
    import nbformat
    root, args, results = repo
    path = root / "notebooks" / "tiny.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell("answer = 42", metadata={"tags": ["solution"]}),
                 nbformat.v4.new_code_cell("repro.check_exercise('== 42', answer)")]
    nbformat.write(nb, path)
    assert main(args + ["lab", "--student", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--ServerApp.root_dir={results / 'lab' / 'student'}" in out and "student versions copied" in out
    student = nbformat.read(results / "lab" / "student" / "tiny.ipynb", as_version=4)
    assert "answer = 42" not in [c.source for c in student.cells]
    assert student.cells[-2].source.endswith("answer = ...") and student.metadata["fedlab_nb_course"]["version"] == "student"
    assert not (results / "lab" / "tiny.ipynb").exists()   # the instructor copies are not written


def test_lab_help_names_the_course_view(capsys):
    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    assert "--student" in capsys.readouterr().out


def test_permission_denied_is_one_line(tmp_path, monkeypatch, capsys):
    """A folder the user may not read or write (seen as a non-root user; root reads anything, so it is simulated)
    ends the command with one line naming the path and the fix, not a traceback."""
    import errno

    from fedlab_nb import cli

    def denied(args):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "res"))

    monkeypatch.setitem(cli.COMMANDS, "list", denied)
    assert main(["--results", str(tmp_path / "res"), "list"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "permission denied on" in err and "res" in err and "--results" in err
