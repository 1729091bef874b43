"""publish's journal (repro/files.py): a publish stopped at any step — killed, or unable to put the old versions
back — is undone by the next reader under the paper's lock, and a journal that publish did not write (planted in
a results folder someone hands over) makes it delete or move nothing."""
import json
import os

import pytest

from fedlab_nb.repro import files

NAMES = ["p-smoke", "p-smoke.ipynb", "p-smoke.json"]


def _results(tmp_path, version):
    out = tmp_path / "results"
    (out / "p-smoke").mkdir(parents=True, exist_ok=True)
    (out / "p-smoke" / "fig.png").write_text(version)
    (out / "p-smoke.ipynb").write_text(version)
    (out / "p-smoke.json").write_text(version)
    return out


def _snapshot(out):
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock") and not str(p.relative_to(out)).startswith(".")}


def _staged(out, version):
    stage = out / ".p-smoke.abc123.running"
    (stage / "p-smoke").mkdir(parents=True)
    (stage / "p-smoke" / "new.png").write_text(version)
    (stage / "p-smoke.ipynb").write_text(version)
    (stage / "p-smoke.json").write_text(version)
    return stage


@pytest.mark.parametrize("stop_at", range(1, 4))
def test_a_publish_stopped_at_any_move_is_undone_by_the_next_reader(tmp_path, monkeypatch, stop_at):
    out = _results(tmp_path, "old")
    before, stage, real = _snapshot(out), _staged(out, "new"), os.replace
    calls = []

    def replace(a, b):  # from the stop_at-th move into the results folder on, the disk refuses (undoing too)
        if os.path.dirname(b) == str(out):
            calls.append(b)
            if len(calls) >= stop_at:
                raise OSError(5, "Input/output error")
        return real(a, b)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(files.ReproError, match="could not be put back"):
        files.publish(stage, out, NAMES)
    monkeypatch.undo()
    assert (stage / files.JOURNAL).is_file()
    files.recover_publishes(out)
    assert _snapshot(out) == before and not stage.exists()


def test_a_publish_that_completed_leaves_no_journal(tmp_path):
    out = _results(tmp_path, "old")
    stage = _staged(out, "new")
    files.publish(stage, out, NAMES)
    assert not (stage / files.JOURNAL).exists() and (out / "p-smoke" / "new.png").is_file()


OTHER = "f:" + "0" * 64  # a digest no file here has


@pytest.mark.parametrize("entries", [
    [["p-smoke.json", OTHER]], [["p-smoke", "d" + OTHER[1:]]],          # the real result, another version
    [["q-smoke.json", OTHER]], [["../p-smoke.json", OTHER]], [["p-smoke/fig.png", OTHER]],   # not this run's names
    [["p-smoke.json"]], "p-smoke.json", [["p-smoke.json", 1, 2]], [["p-smoke.json", "f:x"]]],
    ids=["result", "figures", "another paper", "dot-dot", "a path", "no identity", "not a list", "an inode",
         "not a digest"])
def test_a_planted_journal_deletes_and_moves_nothing(tmp_path, entries):
    out = _results(tmp_path, "real")
    before = _snapshot(out)
    stage = out / ".p-smoke.zzz999.running"
    stage.mkdir()
    (stage / "p-smoke.json.old").write_text("planted")
    (stage / files.JOURNAL).write_text(json.dumps(entries))
    files.recover_publishes(out)
    assert _snapshot(out) == before  # nothing of the results moved or deleted; the planted file never moved in
    # the hidden staging folder is the package's own (the next run removes such folders anyway): kept, or gone whole
    assert not stage.exists() or (stage / "p-smoke.json.old").read_text() == "planted"


def test_a_journal_acts_only_on_the_versions_it_names(tmp_path):
    """A journal this user's publish signed undoes only a version it names by content, under one of the run's own
    names (the same journal unsigned, as one planted in a handed-over folder would be, does nothing: below)."""
    out = _results(tmp_path, "real")
    stage = out / ".p-smoke.zzz999.running"
    stage.mkdir()
    files._write_journal(stage, [["p-smoke.json", files._identity(out / "p-smoke.json"), None]])  # signed here
    files.recover_publishes(out)  # the version matches (a "new version where there was none"): only that file goes
    assert sorted(_snapshot(out)) == ["p-smoke.ipynb", "p-smoke/fig.png"]


def test_a_version_is_known_by_its_content_not_its_inode(tmp_path):
    out = _results(tmp_path, "v1")
    folder, file = files._identity(out / "p-smoke"), files._identity(out / "p-smoke.json")
    assert folder.startswith("d:") and file.startswith("f:") and files.DIGEST.fullmatch(folder)
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # other inodes, same content: the same versions
    assert (files._identity(copy / "p-smoke"), files._identity(copy / "p-smoke.json")) == (folder, file)
    (out / "p-smoke.json").write_text("v2")  # the same inode, newer content: another version
    (out / "p-smoke" / "fig.png").write_text("v2")
    assert files._identity(out / "p-smoke.json") != file and files._identity(out / "p-smoke") != folder
    assert files._identity(out / "missing") is None
    os.mkfifo(out / "p-smoke" / "pipe")  # a FIFO inside is counted by kind, never opened
    assert files.DIGEST.fullmatch(files._identity(out / "p-smoke"))


def test_a_journal_not_signed_with_this_users_key_is_never_followed(tmp_path, monkeypatch):
    out = _results(tmp_path, "real")
    before = _snapshot(out)
    stage = out / ".p-smoke.zzz999.running"
    stage.mkdir()
    entries = [["p-smoke.json", files._identity(out / "p-smoke.json"), None]]
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "someone else"))  # another user's key signs it
    files._write_journal(stage, entries)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "me"))
    files.recover_publishes(out)
    assert _snapshot(out) == before and (stage / files.JOURNAL).is_file()
    (stage / files.JOURNAL).write_text(json.dumps({"entries": entries, "mac": None}))  # unsigned
    files.recover_publishes(out)
    assert _snapshot(out) == before


def test_a_recovery_that_meets_a_newer_version_keeps_the_old_one_and_retires_the_journal(tmp_path, capsys):
    out = _results(tmp_path, "old")
    stage = _staged(out, "new")
    real = os.replace
    calls = []

    def die(a, b):  # killed after the second move into the results folder (figures and notebook are in)
        if os.path.dirname(b) == str(out):
            calls.append(b)
            if len(calls) == 3:
                raise KeyboardInterrupt
        return real(a, b)
    os.replace = die
    try:
        files._recover, saved = (lambda *a, **k: False), files._recover  # the undo itself is killed too
        with pytest.raises(files.ReproError):
            files.publish(stage, out, NAMES)
    finally:
        os.replace, files._recover = real, saved
    (out / "p-smoke.ipynb").write_text("newer, by hand")  # written before any reader recovered
    files.recover_publishes(out)
    kept = list(out.glob(".p-smoke.*.kept"))
    assert (out / "p-smoke.ipynb").read_text() == "newer, by hand" and len(kept) == 1
    assert (out / "p-smoke" / "fig.png").read_text() == "old" and (out / "p-smoke.json").read_text() == "old"
    assert not (kept[0] / files.JOURNAL).exists() and "kept" in capsys.readouterr().err
    files.recover_publishes(out)  # retired: never acted on again
    assert (out / "p-smoke.ipynb").read_text() == "newer, by hand"


def _key_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "fedlab_nb" / "journal.key"


def test_the_key_is_made_once_private_and_whole_even_by_processes_racing(tmp_path, monkeypatch):
    import multiprocessing
    key_path = _key_home(tmp_path, monkeypatch)
    with multiprocessing.get_context("fork").Pool(8) as pool:  # each reads the key right after making it
        keys = pool.map(_read_key, range(32))
    assert set(keys) == {key_path.read_bytes()} and len(keys[0]) == 32
    assert key_path.stat().st_mode & 0o777 == 0o600 and key_path.parent.stat().st_mode & 0o077 == 0
    assert os.listdir(key_path.parent) == ["journal.key"]  # no temporary key left behind


def _read_key(_):
    return files._journal_key()


@pytest.mark.parametrize("bad", ["short", "readable by others", "a link"])
def test_a_key_that_cannot_be_trusted_signs_nothing(tmp_path, monkeypatch, bad):
    key_path = _key_home(tmp_path, monkeypatch)
    key_path.parent.mkdir(parents=True)
    if bad == "short":  # a key cut off mid-write
        key_path.write_bytes(os.urandom(10))
    elif bad == "readable by others":
        key_path.write_bytes(os.urandom(32))
        key_path.chmod(0o644)
    else:
        (tmp_path / "elsewhere").write_bytes(os.urandom(32))
        key_path.symlink_to(tmp_path / "elsewhere")
    assert files._journal_key() is None and files._signature(tmp_path, []) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the key another owner")
def test_a_key_owned_by_another_user_signs_nothing(tmp_path, monkeypatch):
    key_path = _key_home(tmp_path, monkeypatch)
    assert files._journal_key() is not None
    os.chown(key_path, 12345, 12345)
    assert files._journal_key() is None


def test_without_hard_links_the_key_is_still_made(tmp_path, monkeypatch):
    key_path = _key_home(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(PermissionError(1, "Operation not permitted")))
    key = files._journal_key()
    assert key is not None and key == key_path.read_bytes() and os.listdir(key_path.parent) == ["journal.key"]


def test_a_relative_xdg_state_home_is_ignored_as_the_xdg_spec_says(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", "state")  # relative: one key per working folder otherwise
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert files._journal_key() is not None
    assert (tmp_path / "home" / ".local" / "state" / "fedlab_nb" / "journal.key").is_file()
    assert not (tmp_path / "state").exists()


def test_many_kept_or_unsigned_folders_make_one_warning_line_each(tmp_path, capsys):
    out = _results(tmp_path, "old")
    for i in range(50):
        (out / f".p-smoke.k{i:02d}.kept").mkdir()
        stage = out / f".p-smoke.u{i:02d}.running"
        stage.mkdir()
        (stage / files.JOURNAL).write_text(json.dumps({"entries": [], "mac": "0" * 64}))  # not signed by this key
    files.recover_publishes(out)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("and 47 more" in line for line in err), err
    assert ".p-smoke.k00.kept" in err[0] and ".p-smoke.u00.running" in err[1]
    assert len(list(out.glob(".*.running"))) == 50  # an unsigned journal is never followed, its folder never removed
