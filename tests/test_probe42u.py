"""Probe 42u: a twenty-first, independent re-run of issue 42's failure classes, aimed at the code changed last: the
signed publish journal (the key under $XDG_STATE_HOME unusable, changed, relative or shared between two users between
a kill and its recovery; journals replayed into another staging folder or paper, reordered or cut; `.kept` folders;
publish's own undo without a key), the DP rule's checked draw (`check_sampled` on ids of odd shapes and kinds, through
DPAggregate, LocalDPAccounting and simulate), `seed_batchable` against every registered method, and fresh variants of
the Flower adapter's refusals, run folder names and the command parameters.json records. Notebooks are replaced by
the stand-in of tests/test_probe42r.py, so no kernel starts. Each test asserts the correct behaviour; a test marked
xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from probes import cli, fed10, root_copy  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_
from probes import one_line_error
from test_probe42r import _first_result, _snapshot, _stand_in
from test_probe42s import _failing_publish, _plant, _results_of, _second_run

from fedlab_nb.repro import files


def _list(root, results):
    return cli(["--root", root, "--results", results, "list"])


def _state(monkeypatch, where):
    monkeypatch.setenv("XDG_STATE_HOME", str(where))
    return where / "fedlab_nb" / "journal.key"


def _strand(tmp_path, monkeypatch):
    """_stranded of test_probe42s with this test's key home kept: a result of value 0.5, then a second run whose
    publish failed at its 2nd move (new figures in, old result file) and whose undo was interrupted."""
    root, results, before = _first_result(tmp_path, monkeypatch)
    _second_run(monkeypatch)
    state = _failing_publish(monkeypatch, results, move=2, undo=KeyboardInterrupt)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    assert rc == 130 and state["undoing"], (rc, err)
    (stage,) = results.glob(".tiny-smoke.*.running")
    assert (stage / files.JOURNAL).is_file() and (results / "tiny-smoke" / "other.png").exists()
    return root, results, before, stage


def _undo_patches(monkeypatch, keep_env):
    """monkeypatch.undo() that keeps XDG_STATE_HOME as it is now (the key home of the test)."""
    value = os.environ.get("XDG_STATE_HOME")
    monkeypatch.undo()
    if keep_env:
        monkeypatch.setenv("XDG_STATE_HOME", value)


# ================================================================================ (A) the key after a kill
# finding 1: the publish journal is followed only when signed with this user's key, and a key that cannot be used
# at recovery time (made group-readable by a backup restore or a synced home, deleted with ~/.local/state and made
# anew, or another XDG_STATE_HOME: a container, sudo, CI) makes every recovery skip the journal without a word:
# `list` keeps listing the old result beside the killed run's figures, for good (the issue's "killing a run ...
# leaves the old result listed with its figures already deleted"), and nothing says that a staging folder holds
# the old versions
@F_(1, "a killed publish whose key became unusable is never put back and nothing says so (old result, new figures)")
@pytest.mark.parametrize("change", ["key made group-readable", "key deleted (a fresh one is made)",
                                    "another XDG_STATE_HOME"])
def test_a_key_that_changed_after_a_kill_keeps_the_old_result_whole_or_says_where_it_is(tmp_path, monkeypatch,
                                                                                       change):
    key = _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    if change == "key made group-readable":
        key.chmod(0o640)
    elif change == "key deleted (a fresh one is made)":
        key.unlink()
    else:
        _state(monkeypatch, tmp_path / "elsewhere")
    rc, out, err = _list(root, results)
    assert rc == 0
    assert _results_of(results) == before or stage.name in err, (sorted(_snapshot(results)), err)


def test_a_key_made_group_readable_and_made_private_again_recovers(tmp_path, monkeypatch):  # held
    key = _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    key.chmod(0o640)
    _list(root, results)
    key.chmod(0o600)
    _list(root, results)
    assert _results_of(results) == before and not stage.exists()


# finding 2 (class 2, relative paths): a relative XDG_STATE_HOME (the XDG spec: "must be absolute ... a relative path
# ... should be ignored") is taken against the current directory: the key is made in ./<relative>/fedlab_nb/ of
# wherever the command runs (a stray key folder in the user's project), and a publish killed in one directory is never
# put back by a `list` run from another (another key), silently
@F_(2, "a relative XDG_STATE_HOME makes the key per working directory: a kill is not recovered from another one")
def test_a_relative_xdg_state_home_gives_one_key_whatever_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("XDG_STATE_HOME", "state")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    first = files._journal_key()
    monkeypatch.chdir(tmp_path / "b")
    assert files._journal_key() == first and not (tmp_path / "a" / "state").exists()


def test_an_empty_xdg_state_home_uses_the_home_folder(tmp_path, monkeypatch):  # held
    monkeypatch.setenv("XDG_STATE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    key = files._journal_key()
    assert key is not None and (tmp_path / "home" / ".local" / "state" / "fedlab_nb" / "journal.key").read_bytes() == key


@pytest.mark.parametrize("kind", ["a file", "a FIFO", "a folder", "a dangling link", "33 bytes"])
def test_a_key_of_another_kind_signs_nothing_and_never_blocks(tmp_path, monkeypatch, kind):  # held
    key = _state(monkeypatch, tmp_path / "state")
    key.parent.mkdir(parents=True, mode=0o700)
    if kind == "a file":  # XDG_STATE_HOME/fedlab_nb is a file
        shutil.rmtree(key.parent)
        key.parent.write_text("x")
    elif kind == "a FIFO":
        os.mkfifo(key, 0o600)
    elif kind == "a folder":
        key.mkdir()
    elif kind == "a dangling link":
        key.symlink_to(tmp_path / "nowhere")
    else:
        key.write_bytes(os.urandom(32) + b"\n")
        key.chmod(0o600)
    assert files._journal_key() is None and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("where", ["a file", "a path through a file"])
def test_publish_without_a_usable_key_still_publishes_whole(tmp_path, monkeypatch, where):  # held
    (tmp_path / "f").write_text("x")
    _state(monkeypatch, tmp_path / "f" if where == "a file" else tmp_path / "f" / "sub")
    root, results, before = _first_result(tmp_path, monkeypatch)
    _second_run(monkeypatch)
    assert cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])[0] == 0
    assert "tiny-smoke/other.png" in _snapshot(results) and "tiny-smoke/new.png" not in _snapshot(results)
    assert not list(results.glob(".tiny-smoke.*"))


def test_publishs_own_undo_without_a_usable_key_puts_the_old_result_back(tmp_path, monkeypatch):  # held
    (tmp_path / "f").write_text("x")
    _state(monkeypatch, tmp_path / "f")
    root, results, before = _first_result(tmp_path, monkeypatch)
    _second_run(monkeypatch)
    _failing_publish(monkeypatch, results, move=2)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    one_line_error(rc, err)
    assert _results_of(results) == before and not list(results.glob(".tiny-smoke.*"))


# ================================================================================ (A) two users, replayed journals
def test_another_users_list_leaves_a_stranded_publish_for_its_owner(tmp_path, monkeypatch):  # held
    _state(monkeypatch, tmp_path / "alice")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=False)
    _state(monkeypatch, tmp_path / "bob")
    stranded = _snapshot(results)
    _list(root, results)
    assert _snapshot(results) == stranded and (stage / files.JOURNAL).is_file()
    _state(monkeypatch, tmp_path / "alice")
    _list(root, results)
    assert _results_of(results) == before


@pytest.mark.parametrize("replay", ["another staging folder of the paper", "another paper's staging folder",
                                    "entries reordered", "one name removed", "mac in capitals", "mac as a list"])
def test_a_tampered_or_replayed_signed_journal_moves_nothing(tmp_path, monkeypatch, replay):  # held
    _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    journal = json.loads((stage / files.JOURNAL).read_text())
    assert len(journal["entries"]) >= 2
    if replay == "another staging folder of the paper":
        stage = stage.rename(results / ".tiny-smoke.aaaaaaaa.running")
    elif replay == "another paper's staging folder":
        (root / "papers" / "tiny2.yaml").write_text((root / "papers" / "tiny.yaml").read_text().replace(
            "id: tiny\n", "id: tiny2\n", 1))
        stage = stage.rename(results / ".tiny2-smoke.aaaaaaaa.running")
    elif replay == "entries reordered":
        journal["entries"].reverse()
    elif replay == "one name removed":
        journal["entries"].pop()
    elif replay == "mac in capitals":
        journal["mac"] = journal["mac"].upper()
    else:
        journal["mac"] = [journal["mac"]]
    if replay not in ("another staging folder of the paper", "another paper's staging folder"):
        (stage / files.JOURNAL).write_text(json.dumps(journal))
    stranded = _snapshot(results)
    _list(root, results)
    assert _snapshot(results) == stranded and (stage / files.JOURNAL).is_file()


# ================================================================================ (A) .kept folders
def _retired(tmp_path, monkeypatch):
    """A stranded publish whose recovery met a newer figures folder (a file added by hand meanwhile): retired to a
    .kept folder."""
    _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    (results / "tiny-smoke" / "mine.txt").write_text("added by hand meanwhile")
    rc, out, err = _list(root, results)
    kept = stage.with_name(stage.name[:-len(".running")] + ".kept")
    assert kept.is_dir() and kept.name in err, (err, sorted(p.name for p in results.iterdir()))
    return root, results, before, kept


def test_a_retired_publish_loses_no_version(tmp_path, monkeypatch):  # held
    root, results, before, kept = _retired(tmp_path, monkeypatch)
    seen = {p.read_bytes() for p in results.rglob("*") if p.is_file()}
    for name, data in before.items():
        assert data in seen, name


def test_a_kept_folder_survives_later_runs_lists_and_reports_untouched(tmp_path, monkeypatch):  # held
    root, results, before, kept = _retired(tmp_path, monkeypatch)
    inside = {str(p.relative_to(kept)): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    _stand_in(monkeypatch)
    for args in (["list"], ["report"], ["reproduce", "tiny", "--force"], ["reproduce", "tiny", "--force"],
                 ["run", "tiny"]):
        cli(["--root", root, "--results", results, *args])
    assert {str(p.relative_to(kept)): p.read_bytes() for p in kept.rglob("*") if p.is_file()} == inside


def test_a_kept_folder_with_a_planted_journal_is_never_followed(tmp_path, monkeypatch):  # held
    root, results, before, kept = _retired(tmp_path, monkeypatch)
    (kept / files.JOURNAL).write_text(json.dumps({"entries": [["tiny-smoke.json", "f:" + "0" * 64, None]],
                                                  "mac": None}))
    now = _snapshot(results)
    _list(root, results)
    assert _snapshot(results) == now


def test_a_link_planted_where_a_retire_renames_to_is_not_followed(tmp_path, monkeypatch):  # held
    _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "precious").write_text("keep me")
    stage.with_name(stage.name[:-len(".running")] + ".kept").symlink_to(tmp_path / "victim")
    (results / "tiny-smoke" / "mine.txt").write_text("added by hand meanwhile")
    _list(root, results)
    assert os.listdir(tmp_path / "victim") == ["precious"]
    versions = {p.read_bytes() for p in results.rglob("*") if p.is_file()}
    assert all(data in versions for data in before.values()), sorted(p.name for p in results.rglob("*"))


# finding 3 (low: the name is random, so only a failing rename reaches it): _retire removes the journal first and
# renames the staging folder to .kept second; when the rename fails (here a link already at the .kept name; any
# OSError does) the staging folder is left without a journal, holding the only copy of the old figures, and the next
# `reproduce` of the paper (recover_run: "a staging folder without a journal is a killed run's") deletes it
@F_(3, "a retire whose rename fails leaves the old versions in a journal-less staging folder the next run deletes")
def test_a_retire_whose_rename_fails_never_loses_the_old_versions(tmp_path, monkeypatch):
    _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    (tmp_path / "victim").mkdir()
    stage.with_name(stage.name[:-len(".running")] + ".kept").symlink_to(tmp_path / "victim")
    (results / "tiny-smoke" / "mine.txt").write_text("added by hand meanwhile")
    _list(root, results)  # the journal is removed, the rename fails (suppressed): no warning
    _second_run(monkeypatch)  # figures other.png, value 0.7: none of the old versions
    cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    versions = {p.read_bytes() for p in results.rglob("*") if p.is_file()}
    assert all(data in versions for data in before.values()), sorted(p.name for p in results.rglob("*"))
