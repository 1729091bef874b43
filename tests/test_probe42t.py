"""Probe 42t: a twentieth, independent re-run of issue 42's failure classes, aimed at the code changed last: the
publish journal that records each new version by content digest (journals planted with the real result's true
digest, a journal kept after a partial recovery and a later run of identical content, huge files and odd figures
folders under the digest, a results folder tarred or moved between a kill and its recovery, identical old and new
versions, an interrupt during the digest, recover_run failing inside reproduce), the DP rule's checked draw
(`_round_ids`) and simulate_seeds with DP and round-metric rules (hand-built RoundInfo of odd ids, empty 2-D
draws, update rows that disagree with the ids, ε and θ against simulate, samplers of every kind, resume at an empty
round, personalised methods), and fresh variants of the Flower adapter's and the CLI's printing and paths.
Notebooks are replaced by the stand-in of tests/test_probe42r.py, so no kernel starts. Each test asserts the
correct behaviour; a test marked xfail(strict=True) is an open finding (its reason says what is wrong), so the suite
stays green until it is fixed."""
import errno
import json
import os
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from probes import cli, fed10, root_copy  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_
from probes import one_line_error
from test_probe42r import _first_result, _snapshot, _stand_in
from test_probe42s import _failing_publish, _plant, _results_of, _second_run, _stranded

from fedlab_nb.repro import files


def _list(root, results):
    return cli(["--root", root, "--results", results, "list"])


# ================================================================================ (A) planted journals, true digests
# finding 1: the journal names each new version by its content digest, which anyone who hands over a results folder
# can compute for every file in it: a staging folder planted there with a journal naming the real figures folder and
# result by their true digests makes `list` delete the figures folder (no `.old` planted) and replace the result
# file with the planted `.old` (the _recover docstring: "a journal planted in a results folder someone hands over
# can delete nothing of its own choosing")
@F_(1, "a planted journal naming the real result by its true digest makes list delete or replace it")
@pytest.mark.parametrize("reader", [["list"], ["report"]])
def test_a_planted_journal_naming_the_real_result_by_its_true_digest_changes_nothing(tmp_path, monkeypatch, reader):
    root, results, before = _first_result(tmp_path, monkeypatch)
    stage = _plant(results, [["tiny-smoke", files._identity(results / "tiny-smoke")],
                             ["tiny-smoke.json", files._identity(results / "tiny-smoke.json")]])
    (stage / "tiny-smoke.json.old").write_text('{"planted": true}')
    cli(["--root", root, "--results", results, *reader])
    assert _results_of(results) == before, sorted(_snapshot(results))


@F_(1, "a planted journal in a run folder deletes its parameters.json by its true digest")
def test_a_planted_journal_naming_a_run_folders_parameters_by_digest_deletes_nothing(tmp_path, monkeypatch):
    root, results = root_copy(tmp_path), tmp_path / "results"
    _stand_in(monkeypatch)
    assert cli(["--root", root, "--results", results, "run", "tiny"])[0] == 0
    (folder,) = (results / "runs").iterdir()
    params = (folder / "parameters.json").read_bytes()
    _plant(folder, [["parameters.json", files._identity(folder / "parameters.json")]])
    _stand_in(monkeypatch, during=lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    cli(["--root", root, "--results", results, "run", "tiny"])  # recovers first, then is interrupted mid-notebook
    assert (folder / "parameters.json").is_file() and (folder / "parameters.json").read_bytes() == params


# finding 2: a journal that a recovery cannot finish (one name holds something newer) is kept for good and stays
# armed: every later `list` deletes whatever appears at its other names with the digest it recorded. A run of the
# same parameters makes the same figures (the seeded notebooks are deterministic), so the next complete run's figures
# folder is deleted by the next `list`, leaving the listed result without its figures; a planted journal does the
# same to a handed-over folder's receiver's own later run
@F_(2, "a kept journal deletes a later complete run's figures folder whose content equals the killed run's")
def test_a_kept_journal_never_deletes_a_later_runs_identical_figures(tmp_path, monkeypatch):
    root, results, before = _first_result(tmp_path, monkeypatch)
    _second_run(monkeypatch)
    _failing_publish(monkeypatch, results, move=3, undo=KeyboardInterrupt)  # figures and notebook moved in, then Ctrl-C
    assert cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])[0] == 130
    monkeypatch.undo()
    notebook = results / "tiny-smoke.ipynb"
    notebook.write_text(notebook.read_text() + " ")  # the user opens the notebook in Jupyter, which saves it
    _list(root, results)  # the figures are put back; the edited notebook is left, and so is the journal
    _second_run(monkeypatch)  # the same run again, complete this time
    assert cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])[0] == 0
    _list(root, results)
    assert (results / "tiny-smoke" / "other.png").is_file(), sorted(_snapshot(results))


@F_(2, "a planted journal kept by a name it cannot restore deletes the receiver's own later figures")
def test_a_planted_journal_waiting_for_the_receivers_own_run_deletes_nothing(tmp_path, monkeypatch):
    _, elsewhere, _ = _first_result(tmp_path / "a", monkeypatch)  # the planter runs the same paper: same figures
    figures = files._identity(elsewhere / "tiny-smoke")
    root, results = root_copy(tmp_path / "v"), tmp_path / "v" / "results"
    results.mkdir()
    (results / "tiny-smoke.notes").write_text("notes")  # a name whose old version never matches: the journal stays
    stage = _plant(results, [["tiny-smoke", figures], ["tiny-smoke.notes", "f:" + "0" * 64]])
    (stage / "tiny-smoke.notes.old").write_text("old notes")
    _stand_in(monkeypatch)
    assert cli(["--root", root, "--results", results, "reproduce", "tiny"])[0] == 0
    _list(root, results)
    assert (results / "tiny-smoke" / "new.png").is_file(), sorted(_snapshot(results))


# finding 3: recovery hashes every file a journal names, whole, at every `list` and `report`: a handed-over results
# folder with a planted journal and a sparse file of a few TB (no disk space) makes every listing read it (4 GB took
# 4.7 s here, so 1 TB is about 20 minutes per `list`, for every paper); the journal itself is read with a size limit
@F_(3, "list hashes a huge sparse file named by a planted journal, whole, every time")
def test_a_huge_sparse_file_named_by_a_planted_journal_is_not_hashed_whole(tmp_path, monkeypatch):
    root, results, before = _first_result(tmp_path, monkeypatch)
    stage = _plant(results, [["tiny-smoke.ipynb", "f:" + "0" * 64]])
    with open(stage / "tiny-smoke.ipynb", "wb") as f:
        f.truncate(512 * 2 ** 20)
    hashed = []
    real = files.hashlib.sha256

    class Counting:
        def __init__(self):
            self.h = real()

        def update(self, chunk):
            hashed.append(len(chunk))
            self.h.update(chunk)

        def hexdigest(self):
            return self.h.hexdigest()
    monkeypatch.setattr(files, "hashlib", SimpleNamespace(sha256=Counting))
    _list(root, results)
    assert sum(hashed) < 64 * 2 ** 20, f"list hashed {sum(hashed) / 2 ** 20:.0f} MB"


# ================================================================================ (A) a stranded folder carried away
def test_a_stranded_results_folder_tarred_and_unpacked_elsewhere_recovers(tmp_path, monkeypatch):  # held
    root, results, before = _stranded(tmp_path, monkeypatch)
    with tarfile.open(tmp_path / "r.tar", "w") as tar:
        tar.add(results, arcname="results")
    shutil.rmtree(results)
    (tmp_path / "unpacked").mkdir()
    with tarfile.open(tmp_path / "r.tar") as tar:
        tar.extractall(tmp_path / "unpacked", filter="tar")
    _list(root, tmp_path / "unpacked" / "results")
    assert _results_of(tmp_path / "unpacked" / "results") == before


def test_a_stranded_results_folder_renamed_then_reproduced_recovers_first(tmp_path, monkeypatch):  # held
    root, results, before = _stranded(tmp_path, monkeypatch)
    moved = tmp_path / "moved"
    os.rename(results, moved)
    _stand_in(monkeypatch, error="RuntimeError")  # were it run again, this run would fail
    rc, out, err = cli(["--root", root, "--results", moved, "reproduce", "tiny"])
    assert rc == 0 and _snapshot(moved) == before, (rc, err)


def _odd_figures(kind):
    """A `during` for the stand-in that adds `kind` to the run's figures folder."""
    def add():
        from fedlab_nb.repro.recording import RUN_DIR_ENV
        run_dir = Path(os.environ[RUN_DIR_ENV])
        if kind == "fifo":
            os.mkfifo(run_dir / "pipe")
        elif kind == "link out":
            (run_dir / "link.png").symlink_to("/etc/hostname")
        elif kind == "deep tree":
            deep = run_dir.joinpath(*["d"] * 60)
            deep.mkdir(parents=True)
            (deep / "leaf.png").write_bytes(b"leaf")
        elif kind == "empty folders":
            (run_dir / "a" / "b").mkdir(parents=True)
        elif kind == "odd names":
            (run_dir / "caf\udce9.png").write_bytes(b"x")  # not UTF-8 on disk
            (run_dir / "\x1b[31m.png").write_bytes(b"y")
    return add


@pytest.mark.parametrize("kind", ["fifo", "link out", "deep tree", "empty folders", "odd names"])
@pytest.mark.parametrize("move", [1, 2, 3])
def test_a_killed_publish_of_odd_figures_folders_is_put_back_by_list(tmp_path, monkeypatch, kind, move):  # held
    root, results, before = _first_result(tmp_path, monkeypatch)
    _stand_in(monkeypatch, figure="other.png", metrics={"value": 0.7, "double": 1.4}, during=_odd_figures(kind))
    _failing_publish(monkeypatch, results, move, undo=KeyboardInterrupt)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    monkeypatch.undo()
    assert rc in (1, 130) and "Traceback" not in err, (rc, err)
    _list(root, results)
    assert _snapshot(results) == before and not list(results.glob(".tiny-smoke.*.running"))


@pytest.mark.parametrize("move", [1, 2, 3])
def test_identical_old_and_new_versions_killed_at_each_move_are_one_whole_result(tmp_path, monkeypatch, move):  # held
    root, results, before = _first_result(tmp_path, monkeypatch)
    _stand_in(monkeypatch)  # the same run again: figures, metrics and notebook equal to the old ones
    _failing_publish(monkeypatch, results, move, undo=KeyboardInterrupt)
    cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    monkeypatch.undo()
    _list(root, results)
    assert _snapshot(results) == before and not list(results.glob(".tiny-smoke.*.running"))


# ================================================================================ (A) interrupts and errors in the digest
def test_ctrl_c_during_the_digest_of_lists_recovery_then_the_next_list_recovers(tmp_path, monkeypatch):  # held
    root, results, before = _stranded(tmp_path, monkeypatch)
    real = files._tree_digest

    def interrupted(path, h):
        raise KeyboardInterrupt
    monkeypatch.setattr(files, "_tree_digest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.recover_publishes(results)
    monkeypatch.setattr(files, "_tree_digest", real)
    rc, out, err = _list(root, results)
    assert rc == 0 and _results_of(results) == before


def test_ctrl_c_during_publishs_own_digest_keeps_the_old_result_and_no_staging(tmp_path, monkeypatch):  # held
    root, results, before = _first_result(tmp_path, monkeypatch)
    _second_run(monkeypatch)
    monkeypatch.setattr(files, "_file_digest", lambda path, h: (_ for _ in ()).throw(KeyboardInterrupt))
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    monkeypatch.undo()
    assert rc == 130 and "Traceback" not in err, (rc, err)
    assert _snapshot(results) == before and not list(results.glob(".tiny-smoke.*.running"))


def test_recovery_failing_inside_reproduce_is_one_line_and_keeps_the_old_versions(tmp_path, monkeypatch):  # held
    root, results, before = _stranded(tmp_path, monkeypatch)
    real = os.replace

    def sick(a, b):
        if Path(b).parent == results:
            raise OSError(errno.EIO, "Input/output error", str(b))
        return real(a, b)
    monkeypatch.setattr(os, "replace", sick)
    _stand_in(monkeypatch)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny"])
    monkeypatch.setattr(os, "replace", real)
    one_line_error(rc, err)
    _list(root, results)
    assert _results_of(results) == before


def test_a_stranded_paper_whose_recovery_fails_never_hides_another_papers_listing(tmp_path, monkeypatch):  # held
    from test_probe42r import _second_paper
    root, results, before = _stranded(tmp_path, monkeypatch)
    _second_paper(root)
    monkeypatch.setattr(files, "_restore", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    rc, out, err = _list(root, results)
    assert rc == 0 and "tiny2" in out and "Traceback" not in err, (rc, err)


def test_a_journal_entry_of_the_other_kind_for_a_name_moves_nothing(tmp_path, monkeypatch):  # held
    root, results, before = _first_result(tmp_path, monkeypatch)
    folder_digest = files._identity(results / "tiny-smoke")
    stage = _plant(results, [["tiny-smoke.json", "f" + folder_digest[1:]], ["tiny-smoke", "d:" + "A" * 64]])
    (stage / "tiny-smoke.json.old").write_text('{"planted": true}')
    _list(root, results)
    assert _results_of(results) == before
