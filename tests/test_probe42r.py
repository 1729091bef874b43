"""Probe 42r: an eighteenth, independent re-run of issue 42's failure classes, aimed first at class 7 (the run
lock held by another process or killed with it, a lock file of garbage, two papers at once, a run interrupted
before, during and after the notebook and at every step of its publish, a full disk or a refused write at each
file the CLI writes, exit statuses at several scales) and class 6 (secure aggregation's messages replayed from
an earlier protocol instance, answered for another client, of out-of-range field elements, a server or client
object reused for a second instance), then at the new sampling tests (fair samplers at many (K, q), evasions)
and a DP resume whose checkpoint holds a hostile `seen_tests`. The notebook is replaced by a stand-in for
papermill that writes what a run writes, so no kernel starts. Each test asserts the correct behaviour; a test
marked xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays green until it
is fixed."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from probes import PNG, cli, fed10, root_copy  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_  # noqa: F401
from probes import one_line_error


# ================================================================================ helpers: a run without a kernel
def _stand_in(monkeypatch, metrics=None, during=None, error=None, figure="new.png"):
    """papermill.execute_notebook replaced: writes a figure, metrics.json and the executed notebook as a real
    run does; `during()` is called after that (an interrupt there is a run killed mid-notebook); `error` makes
    the notebook fail in cell 2."""
    import papermill

    from fedlab_nb.repro.recording import RUN_DIR_ENV

    def execute(source, executed, parameters=None, **kw):
        run_dir = Path(os.environ[RUN_DIR_ENV])
        value = (parameters or {}).get("value", 0.5)
        (run_dir / figure).write_bytes(PNG + str(value).encode())
        got = {"value": value, "double": 2 * value} if metrics is None else metrics
        (run_dir / "metrics.json").write_text(json.dumps(got))
        Path(executed).write_text(json.dumps({"value": value}))
        if during is not None:
            during()
        if error is not None:
            raise papermill.PapermillExecutionError(2, 1, "x", error, "asked to fail", [])
    monkeypatch.setattr(papermill, "execute_notebook", execute)


def _snapshot(results):
    """Every file of the results folder (the lock and hidden staging folders aside): {relative path: bytes}."""
    return {str(p.relative_to(results)): p.read_bytes() for p in sorted(results.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock") and not any(s.startswith(".") for s in p.relative_to(
                results).parts)}


def _first_result(tmp_path, monkeypatch, *more):
    """A root with a completed smoke result of `tiny` (value 0.5) in results/; returns (root, results, snapshot)."""
    root, results = root_copy(tmp_path), tmp_path / "results"
    _stand_in(monkeypatch)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", *more])
    assert rc == 0, (rc, out, err)
    return root, results, _snapshot(results)


def _lock_free(results, paper="tiny"):
    """Whether another process could take the paper's lock now (no leftover holder)."""
    from fedlab_nb.repro.files import run_lock
    with run_lock(results, paper, "smoke"):
        return True


def _second_paper(root, pid="tiny2"):
    text = (root / "papers" / "tiny.yaml").read_text().replace("id: tiny\n", f"id: {pid}\n", 1)
    (root / "papers" / f"{pid}.yaml").write_text(text)


HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from fedlab_nb.repro.files import run_lock
    with run_lock({results!r}, {paper!r}, "paper"):
        print("held", flush=True)
        time.sleep(60)
""")


def _holder(results, paper="tiny"):
    """A separate process holding the paper's run lock (as a concurrent `reproduce` does); started and waiting."""
    code = HOLDER.format(repo=str(Path(__file__).resolve().parents[1]), results=str(results), paper=paper)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held", p.stderr.read()
    return p


# ================================================================================ (7) the lock across processes
def test_a_run_while_another_process_holds_the_lock_is_one_line_naming_it(tmp_path, monkeypatch):  # held
    root, results, before = _first_result(tmp_path, monkeypatch)
    p = _holder(results)
    try:
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
        one_line_error(rc, err)
        assert rc == 1 and f"process {p.pid}" in err and "scale paper" in err
    finally:
        p.kill()
        p.wait()
    assert _snapshot(results) == before


def test_a_lock_holder_killed_with_sigkill_leaves_the_paper_free(tmp_path, monkeypatch):  # held
    root, results, _ = _first_result(tmp_path, monkeypatch)
    p = _holder(results)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert (results / "tiny.lock").exists()  # the killed process could not remove it: a stale lock file
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    assert rc == 0, (rc, err)


def test_another_paper_runs_while_one_paper_is_locked_by_another_process(tmp_path, monkeypatch):  # held
    root, results, _ = _first_result(tmp_path, monkeypatch)
    _second_paper(root)
    p = _holder(results, "tiny")
    try:
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny2"])
    finally:
        p.kill()
        p.wait()
    assert rc == 0 and (results / "tiny2-smoke.json").is_file(), (rc, err)


def test_reproduce_all_with_one_paper_locked_runs_the_others_and_exits_non_zero(tmp_path, monkeypatch):  # held
    root, results, _ = _first_result(tmp_path, monkeypatch)
    _second_paper(root)
    p = _holder(results, "tiny")
    try:
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "--all", "--force", "-j", "1"])
    finally:
        p.kill()
        p.wait()
    assert rc == 1 and (results / "tiny2-smoke.json").is_file() and "another run of tiny" in err, (rc, out, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("body", [b"\xff\xfe garbage \x00", b"", b"{\"pid\": \"x\"}", b"[" * 100_000],
                         ids=["binary", "empty", "pid text", "deep JSON"])
def test_a_lock_file_of_garbage_nobody_holds_does_not_block(tmp_path, monkeypatch, body):  # held
    root, results, _ = _first_result(tmp_path, monkeypatch)
    (results / "tiny.lock").write_bytes(body)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    assert rc == 0, (rc, err)
    assert not (results / "tiny.lock").exists()


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch):  # held
    root, results, before = _first_result(tmp_path, monkeypatch)
    real = os.open

    def refuse(path, *a, **kw):
        if str(path).endswith("tiny.lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(os, "open", refuse)
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    monkeypatch.setattr(os, "open", real)
    one_line_error(rc, err)
    assert "tiny.lock" in err and _snapshot(results) == before


@pytest.mark.parametrize("stop", ["notebook error", "interrupt mid-notebook", "disk full writing the result"])
def test_the_lock_is_released_after_a_failed_or_interrupted_run(tmp_path, monkeypatch, stop):  # held
    from fedlab_nb.repro import runner
    root, results, _ = _first_result(tmp_path, monkeypatch)
    if stop == "notebook error":
        _stand_in(monkeypatch, error="RuntimeError")
    elif stop == "interrupt mid-notebook":
        _stand_in(monkeypatch, during=lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    else:
        monkeypatch.setattr(runner, "write_json_atomic",
                            lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "--force"])
    assert rc in (1, 130) and "Traceback" not in err, (rc, err)
    assert not (results / "tiny.lock").exists() and _lock_free(results)
    assert not list(results.glob(".tiny-smoke.*.running"))
