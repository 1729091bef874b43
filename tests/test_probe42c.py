"""Probe 42c: a third, independent re-run of issue 42's failure classes with variants that test_reliability3.py
and test_probe42.py do not try. Each test asserts the correct behaviour; a test marked xfail(strict=True) is an
open finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
from probes import KW, REPO, fed10, flower_reply, one_line_error, root_copy, trace



def cli(args):
    """(exit status, stdout, stderr); an exception escaping main() is turned into a status that fails the checks."""
    from fedlab_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in args])
    except Exception as e:  # noqa: BLE001 -- a traceback is the finding
        return f"raised {type(e).__name__}: {str(e)[:200]}", out.getvalue(), err.getvalue()
    return rc, out.getvalue(), err.getvalue()


def cli_process(args, timeout=30, **kw):
    """The CLI in its own process (python -c, so __main__ has no __spec__, as under the console script)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = "import sys; from fedlab_nb.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def no_control(text):
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), repr(text[:300])


GOOD = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced",
        "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "interval": None,
                    "role": "headline"}]}


# ================================================================================ (1) DP rounds and accountant
def test_dp_adaptive_clipping_noises_empty_rounds(fed10):
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=0.5, clip_norm=0.5, sampling_rate=0.1,
                                             adaptive=True, clip_count_stddev=1.0)
    h, seen = trace(method, fed10, sampler, 8)
    assert (h["n_sampled"] == 0).any()
    assert all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1]))
    assert np.isfinite(h["epsilon"]).all() and np.isfinite(h["clip_norm"]).all()


def test_dp_every_update_dropped_as_nonfinite_is_still_a_noised_round(fed10):
    import dataclasses
    from fedlab_nb.core.messages import Transform

    @dataclasses.dataclass
    class NaNify(Transform):
        def __call__(self, msgs, cstate, ctx):
            msgs.tensors["delta"] = torch.full_like(msgs["delta"], float("nan"))
            return msgs, cstate
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3)
    method = dataclasses.replace(method, uplink=(*method.uplink, NaNify()))
    with pytest.warns(UserWarning):
        h, seen = trace(method, fed10, sampler, 4, on_nonfinite="drop")
    assert all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1]))
    assert np.isfinite(h["epsilon"]).all()


def test_dp_resumed_run_accounts_every_round(fed10, tmp_path):
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    full, _ = trace(method, fed10, sampler, 6)
    ck = tmp_path / "ck.pt"

    def stop(r, theta, row):
        if r == 3:
            raise KeyboardInterrupt  # a killed run: rounds 1-3 are in the checkpoint
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(method, fed10, rounds=6, clients_per_round=sampler, seed=0, checkpoint=ck, callback=stop, **KW)
    resumed, _ = trace(method, fed10, sampler, 6, checkpoint=ck, resume=True)
    assert np.allclose(resumed["epsilon"], full["epsilon"]) and np.isfinite(resumed["epsilon"]).all()


@pytest.mark.parametrize("call", [
    pytest.param(lambda A: A.epsilon(0.1, 1e300, 10, 1e-5), id="z 1e300"),
    pytest.param(lambda A: A.epsilon(0.1, 1.0, 10**30, 1e-5, "pld"), id="pld steps 1e30"),
    pytest.param(lambda A: A.epsilon(0.1, 1e-3, 10, 1e-5, "pld"), id="pld z 1e-3"),
    pytest.param(lambda A: A.noise_for_epsilon(1.0, 0.1, 0, 1e-5), id="noise_for_epsilon steps 0"),
])
def test_accountant_edge_inputs_give_a_number_or_a_named_error(call):
    from fedlab_nb.methods.privacy import accounting as A
    try:
        eps = call(A)
    except (ValueError, TypeError) as e:
        assert re.search(r"noise_multiplier|steps|target_epsilon|z\b", str(e)), str(e)
    else:
        assert eps >= 0


@pytest.mark.parametrize("args", [(1.0, "3", 1e-5), ("1.0", 3, 1e-5), (1.0, 2.7, 1e-5), (True, 3, 1e-5)],
                         ids=["participations str", "z str", "participations 2.7", "z bool"])
def test_local_epsilon_refuses_what_epsilon_refuses(args):
    from fedlab_nb.methods.privacy import dp
    with pytest.raises((TypeError, ValueError)):
        dp.local_epsilon(*args)


# ================================================================================ (2) paths, links, devices
@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_report_does_not_write_through_a_hard_link(tmp_path, name):
    root, results, victim = root_copy(tmp_path), tmp_path / "results", tmp_path / "victim.txt"
    results.mkdir()
    victim.write_text("precious")
    os.link(victim, results / name)
    cli(["--root", root, "--results", results, "report"])
    assert victim.read_text() == "precious"


def test_lock_file_hard_link_does_not_truncate_its_target(tmp_path):
    from fedlab_nb.repro.files import run_lock
    from fedlab_nb.repro.claims import ReproError
    results, victim = tmp_path / "results", tmp_path / "victim.txt"
    results.mkdir()
    victim.write_text("precious")
    os.link(victim, results / "tiny.lock")
    with contextlib.suppress(ReproError):
        with run_lock(results, "tiny", "smoke"):
            pass
    assert victim.read_text() == "precious"


def test_lab_fresh_does_not_write_through_a_hard_link(tmp_path):
    root, results, victim = root_copy(tmp_path), tmp_path / "results", tmp_path / "victim.txt"
    (results / "lab").mkdir(parents=True)
    victim.write_text("precious")
    os.link(victim, results / "lab" / "tiny.ipynb")
    cli(["--root", root, "--results", results, "lab", "--fresh", "--dry-run"])
    assert victim.read_text() == "precious"


def test_lab_does_not_copy_a_notebook_link_that_leaves_the_repository(tmp_path):
    root, results = root_copy(tmp_path), tmp_path / "results"
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    os.symlink(secret, root / "notebooks" / "leak.ipynb")
    cli(["--root", root, "--results", results, "lab", "--dry-run"])
    copy = results / "lab" / "leak.ipynb"
    assert not copy.exists() or "SECRET" not in copy.read_text()


def test_lab_with_a_fifo_notebook_is_one_line(tmp_path):
    root, results = root_copy(tmp_path), tmp_path / "results"
    os.mkfifo(root / "notebooks" / "pipe.ipynb")
    rc, out, err = cli(["--root", root, "--results", results, "lab", "--dry-run"])
    assert rc == 0 or (rc in (1, 2) and "pipe.ipynb" in err), (rc, err)


def test_list_does_not_hang_on_a_fifo_claims_file(tmp_path):
    root = root_copy(tmp_path)
    os.mkfifo(root / "papers" / "pipe.yaml")
    try:
        p = cli_process(["--root", root, "--results", tmp_path / "res", "list"], timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("fedlab-nb list blocked on papers/pipe.yaml (a FIFO) for 60 s")
    assert "pipe" in p.stderr and "Traceback" not in p.stderr


def test_history_does_not_hang_on_a_fifo_sidecar(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text("round,train_loss,test_acc\n1,0.5,0.9\n")
    os.mkfifo(tmp_path / "h.json")
    try:
        out = cli_process(["history", p], timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail("fedlab-nb history blocked on h.json (a FIFO) for 15 s")
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["report", "list"])
def test_a_results_name_too_long_is_one_line(tmp_path, command):
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / ("a" * 300), command])
    one_line_error(rc, err)


def test_relative_results_env_is_resolved_once(tmp_path, monkeypatch):
    root = root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLAB_NB_RESULTS", "rel/res")
    rc, out, err = cli(["--root", root, "report"])
    assert rc == 0, err
    assert (tmp_path / "rel" / "res" / "REPORT.md").is_file()


@pytest.mark.parametrize("where", ["runs", "lab", "tiny-smoke", "tiny-smoke.ipynb", "tiny.lock"])
def test_symlinks_in_results_are_refused_not_followed(tmp_path, where):
    from fedlab_nb.repro.files import UnsafePathError, refuse_link, run_lock
    results, target = tmp_path / "results", tmp_path / "elsewhere"
    results.mkdir()
    target.mkdir()
    (results / where).symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        if where == "tiny.lock":
            with run_lock(results, "tiny", "smoke"):
                pass
        else:
            refuse_link(results / where)
    assert list(target.iterdir()) == []


def test_result_file_paper_field_cannot_pull_a_file_from_outside_into_the_board(tmp_path):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = {**GOOD, "paper": "x", "verdict": "MARKER_FROM_OUTSIDE",
            "claims": [{**GOOD["claims"][0], "verdict": "MARKER_FROM_OUTSIDE"}]}
    (outside / "evil.json").write_text(json.dumps(evil))
    rel = os.path.relpath(outside / "evil", root / "papers" / "paper_scale")
    (results / "tiny-smoke.json").write_text(json.dumps({**GOOD, "paper": rel}))
    cli(["--root", root, "--results", results, "report"])
    for name in ("REPORT.md", "index.html"):
        p = results / name
        assert not p.exists() or "MARKER_FROM_OUTSIDE" not in p.read_text().upper()


# ================================================================================ (3) claims / result files as input
@pytest.mark.parametrize("edit", [
    lambda t: t + "? [a, b]\n: 1\n",
    lambda t: t + "? {a: 1}\n: 1\n",
    lambda t: t.replace("smoke: {device: cpu, seconds: 10, parameters: {n_points: 4}}",
                        "smoke: {device: cpu, seconds: 10, parameters: {? [x]: 4}}"),
], ids=["list key", "map key", "list key nested"])
def test_an_unhashable_yaml_key_is_one_line(tmp_path, edit):
    root = root_copy(tmp_path, edit)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    one_line_error(rc, err)
    assert "tiny.yaml" in err
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert "INVALID" in err


@pytest.mark.parametrize("edit", [
    lambda t: "\ufeff" + t, lambda t: t.replace("\n", "\r\n"),
    lambda t: t.replace("smoke: {device: cpu, seconds: 10, parameters: {n_points: 4}}",
                        "smoke: {<<: {device: cpu}, seconds: 10, parameters: {n_points: 4}}"),
    lambda t: t.replace("parameters: {n_points: 4}", "parameters: {n_points: 4, n_points: 5}"),
    lambda t: t.replace("parameters: {n_points: 4}", "parameters: {n_points: !!python/object:os.system 4}"),
    lambda t: t.replace("parameters: {n_points: 4}", "parameters: {n_points: &a 4, value: *a}"),
], ids=["BOM", "CRLF", "merge key", "nested duplicate", "python tag", "nested alias"])
def test_yaml_tricks_are_read_or_refused_in_one_line(tmp_path, edit):
    root = root_copy(tmp_path, edit)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    assert rc == 0 or (rc in (1, 2) and "Traceback" not in err and len(err.strip().splitlines()) == 1), err


@pytest.mark.parametrize("value", [".inf", ".nan", "-5"])
def test_scale_seconds_must_be_a_finite_positive_number(tmp_path, value):
    root = root_copy(tmp_path, lambda t: t.replace("seconds: 10", f"seconds: {value}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    one_line_error(rc, err)
    assert "seconds" in err


@pytest.mark.parametrize("expect", ["< 1e308 * 10", "< 1e308 + 1e308", "> -1e308 * 10", "between -1e308 * 10 and 0"])
def test_an_expectation_that_overflows_to_inf_is_refused(tmp_path, expect):
    root = root_copy(tmp_path, lambda t: t.replace('expect: ">= 10"', f'expect: "{expect}"'))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    one_line_error(rc, err)
    assert "expect" in err


@pytest.mark.parametrize("requires", ["['__main__']", "['__main__', 'no_such_module_xyz']"])
def test_requires_main_does_not_stop_reproduce_all(tmp_path, requires):
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb",
                                                   f"notebook: notebooks/tiny.ipynb\nrequires: {requires}"))
    if requires == "['__main__']":
        pytest.skip("would run the notebook once the crash is fixed; the second variant covers it")
    p = cli_process(["--root", root, "--results", tmp_path / "res", "reproduce", "--all"], timeout=120)
    assert "Traceback" not in p.stderr, p.stderr[-400:]


# ================================================================================ (8) control characters printed
def test_list_does_not_print_control_characters_from_a_claims_file_name(tmp_path):
    root = root_copy(tmp_path)
    shutil.copy(root / "papers" / "tiny.yaml", root / "papers" / "\x1b[2Jevil\x1b]0;t\x07.yaml")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    no_control(out + err)


def test_params_example_line_has_no_control_characters(tmp_path):
    root = root_copy(tmp_path)
    nbp = root / "notebooks" / "tiny.ipynb"
    nb = json.loads(nbp.read_text())
    src = nb["cells"][1]["source"]
    src = src if isinstance(src, str) else "".join(src)
    nb["cells"][1]["source"] = src.replace("seed = 0", 'label = "\x1b]8;;http://evil\x07click\x1b]8;;\x07"\nseed = 0')
    nbp.write_text(json.dumps(nb))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    assert rc == 0, err
    no_control(out + err)


@pytest.mark.parametrize("field, value", [("method", "Tiny \u202eevil\u202c"), ("method", "Tiny\rOVERWRITE"),
                                          ("method", "Tiny \x9b2J csi")])
def test_list_strips_bidi_cr_and_c1_from_claims_files(tmp_path, field, value):
    root = root_copy(tmp_path, lambda t: t.replace('method: "Tiny — harness fixture"', f"method: {json.dumps(value)}"))
    for cmd in (["list"], ["params", "tiny"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res"] + cmd)
        assert rc == 0, err
        assert not re.search("[\r\u202a-\u202e\x80-\x9f]", out + err), repr(out)


@pytest.mark.parametrize("bad", [{"stale": "\x1b[2Jx"}, {"scale": "smoke\x1b[2J"}, {"paper": "tiny\x1b]0;t\x07"}])
def test_report_summary_strips_control_characters_from_result_fields(tmp_path, bad):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(json.dumps({**GOOD, **bad}))
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    no_control(out + err)
    rc, out, err = cli(["--root", root, "--results", results, "list", "--claims"])
    no_control(out + err)


# ================================================================================ (7) CLI input
@pytest.mark.parametrize("value, ok", [("1e-3", True), ("+1.5", True), ("0x10", False), ("2024-01-01", False),
                                       ("!!timestamp 2024-01-01", False), ("!!binary aGk=", False), ("1_000", False),
                                       ("\u0661", False), ("{a: .nan}", False)])
def test_p_values_are_typed_or_refused_in_one_line(tmp_path, value, ok):
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny", "-p", "value", value,
                        "-p", "n_points", "abc"])  # n_points abc: refused before anything runs, whatever value does
    one_line_error(rc, err)
    assert ("n_points" in err) if ok else ("value" in err or "n_points" in err)


@pytest.mark.parametrize("paper", ["ti/ny", "..", "t\u0131ny", "tiny\x00", "tiny " * 20, "\u202etiny"])
def test_bad_paper_ids_are_one_line_and_not_echoed_raw(tmp_path, paper):
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "params", paper])
    one_line_error(rc, err)
    no_control(err)
    assert "\u202e" not in err


def test_results_under_a_file_is_one_line(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", f / "sub", "report"])
    one_line_error(rc, err)


def test_lab_as_root_passes_allow_root(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "lab", "--dry-run"])
    assert rc == 0 and "--allow-root" in out


# ================================================================================ (6) concurrency
def test_a_second_run_of_the_same_paper_is_refused_naming_the_first(tmp_path):
    from fedlab_nb.repro.files import RunLockedError, run_lock
    results = tmp_path / "results"
    with run_lock(results, "tiny", "smoke"):
        with pytest.raises(RunLockedError, match=f"process {os.getpid()}"):
            with run_lock(results, "tiny", "paper"):
                pass
    assert not (results / "tiny.lock").exists()


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path):
    from fedlab_nb.repro.files import run_lock
    results = tmp_path / "results"
    results.mkdir()
    code = ("import os, sys; from fedlab_nb.repro.files import run_lock\n"
            f"cm = run_lock({str(results)!r}, 'tiny', 'smoke'); cm.__enter__(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=60)
    assert (results / "tiny.lock").exists()  # left behind by the killed run
    with run_lock(results, "tiny", "smoke"):
        pass


def test_a_killed_run_leaves_the_old_result_and_its_figures(tmp_path):
    from fedlab_nb.repro.files import publish, staging
    out = tmp_path / "results"
    (out / "tiny-smoke").mkdir(parents=True)
    (out / "tiny-smoke" / "main.png").write_bytes(b"old")
    (out / "tiny-smoke.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with staging(out, "tiny-smoke") as tmp:
            (tmp / "tiny-smoke").mkdir()
            (tmp / "tiny-smoke.json").write_text("new")
            raise KeyboardInterrupt
    assert (out / "tiny-smoke" / "main.png").read_bytes() == b"old" and (out / "tiny-smoke.json").read_text() == "old"
    assert not list(out.glob(".tiny-smoke.*.running"))


# ================================================================================ (4) secure aggregation
def secagg_stages(n=4, t=3, m=5, dropped=()):
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggClient, SecAggParams, SecAggServer
    params = SecAggParams(t, m, 32)
    x = np.arange(n * m, dtype=np.int64).reshape(n, m) * 7
    clients = {u: SecAggClient(u, x[u], params, np.random.default_rng(100 + u)) for u in range(n)}
    server = SecAggServer(params, range(n))
    return params, x, clients, server


def run_to_unmask(clients, server, dropped=()):
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
    surv = server.collect_masked({u: c.masked_input(inbox[u]) for u, c in clients.items() if u not in dropped})
    return {u: c.unmask(surv) for u, c in clients.items() if u not in dropped}


def test_secagg_honest_run_is_exact():
    params, x, clients, server = secagg_stages()
    msgs = run_to_unmask(clients, server, dropped=(3,))
    assert np.array_equal(server.unmask(msgs), x[:3].sum(0).astype(np.uint64))


def test_secagg_replayed_unmasking_message_aborts_not_a_wrong_sum():
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    params, x, clients, server = secagg_stages()
    msgs = run_to_unmask(clients, server)
    msgs[0] = msgs[1]
    with pytest.raises(SecAggAbort, match="client 0"):
        total = server.unmask(msgs)
        assert np.array_equal(total, x.sum(0).astype(np.uint64)), "wrong sum, no error"


def test_secagg_corrupt_secret_key_share_aborts_naming_the_sender():
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort, _ID
    params, x, clients, server = secagg_stages()
    msgs = run_to_unmask(clients, server, dropped=(3,))
    data = bytearray(msgs[0])
    o = 0
    while o < len(data):  # find the S-share record for user 3 and flip one byte of it
        v, kind = _ID.unpack_from(data, o)[0], data[o + 4]
        size = 16 if kind == 0 else 32
        if v == 3:
            data[o + 5] ^= 0xFF
        o += 5 + size
    msgs[0] = bytes(data)
    with pytest.raises(SecAggAbort, match="client 0"):
        total = server.unmask(msgs)
        assert np.array_equal(total, x[:3].sum(0).astype(np.uint64)), "wrong sum, no error"


def test_secagg_copied_public_key_aborts_naming_the_senders():
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    params, x, clients, server = secagg_stages()
    keys = {u: c.advertise_keys() for u, c in clients.items()}
    keys[2] = keys[1]
    with pytest.raises(SecAggAbort) as e:
        roster = server.collect_keys(keys)
        for c in clients.values():
            c.share_keys(roster)
    assert re.search(r"\b(client|user)s? \[?(1, )?2\b", str(e.value)), str(e.value)


@pytest.mark.parametrize("msg", [b"", b"\x00" * 19, "str", bytearray(20), None])
def test_secagg_malformed_masked_input_aborts_naming_the_sender(msg):
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    params, x, clients, server = secagg_stages()
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
    masked = {u: c.masked_input(inbox[u]) for u, c in clients.items()}
    masked[2] = msg
    with pytest.raises(SecAggAbort, match="client 2"):
        server.collect_masked(masked)


@pytest.mark.parametrize("key", [np.uint64(2 ** 64 - 1), "1", 4.0, -1, None, 2 ** 32])
def test_secagg_message_from_a_bad_id_aborts(key):
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    params, x, clients, server = secagg_stages()
    keys = {u: c.advertise_keys() for u, c in clients.items()}
    keys[key] = keys.pop(3)
    with pytest.raises(SecAggAbort):
        server.collect_keys(keys)


def test_secure_aggregation_short_client_sizes_is_a_named_error():
    from fedlab_nb.core.messages import Messages
    from fedlab_nb.methods.privacy.secure_aggregation import SecureAggregation
    t = SecureAggregation(threshold=2, client_sizes=(10, 10))
    ctx = SimpleNamespace(generator=torch.Generator().manual_seed(0), on_nonfinite="raise")
    with pytest.raises(ValueError, match="client_sizes|client 2"):
        t(Messages({"delta": torch.full((3, 4), 0.1)}, np.array([0, 1, 2])), {}, ctx)


# ================================================================================ (5) Flower adapter
def flower_strategy(fed, sampled=(0, 1, 2), method="fedavg"):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import MethodStrategy, _setup
    s = MethodStrategy(_setup(method, fed, "logreg", rounds=1, clients_per_round=3))
    s.nodes, s.sampled, s._t0 = {k: 100 + k for k in range(fed.num_clients)}, np.array(sampled), 0.0
    s.down, s.theta_bytes = {"theta": s.theta}, 0
    return s


@pytest.mark.parametrize("metrics, ks", [
    pytest.param({"bytes-up": 1e20}, [0], id="bytes-up 1e20"),
    pytest.param({"num-examples": 1e308}, [0, 1], id="num-examples 1e308"),
    pytest.param({"num-examples": 0}, [0], id="num-examples 0 only reply"),
])
def test_flower_counts_that_break_the_aggregate_are_refused(fed10, metrics, ks):
    s = flower_strategy(fed10)
    try:
        s.aggregate_train(1, [flower_reply(s, k, **metrics) for k in ks])
    except ValueError as e:
        assert "client 0" in str(e)
    else:
        assert torch.isfinite(s.theta).all(), "θ released non-finite"


@pytest.mark.parametrize("pid", ["\u00b3", "\u2460"])
def test_flower_partition_id_unicode_digit_is_a_clear_error(pid):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import _client_id
    with pytest.raises(ValueError, match="partition-id"):
        _client_id(SimpleNamespace(node_config={"partition-id": pid}), 10)


@pytest.mark.parametrize("pid, ok", [("3", 3), (" 3 ", 3), ("03", 3), (3, 3)])
def test_flower_partition_id_plain_forms(pid, ok):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import _client_id
    assert _client_id(SimpleNamespace(node_config={"partition-id": pid}), 10) == ok


@pytest.mark.parametrize("pid", ["-1", "10", "3.0", 3.0, True, None, "", "0x3", "+3"])
def test_flower_partition_id_bad_forms_are_refused(pid):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import _client_id
    with pytest.raises(ValueError, match="partition-id"):
        _client_id(SimpleNamespace(node_config={"partition-id": pid}), 10)


@pytest.mark.parametrize("which", ["other id", "unsampled", "repeat", "unknown node", "nan drop"])
def test_flower_reply_identity_and_nonfinite(fed10, which):
    s = flower_strategy(fed10)
    if which == "other id":
        r = flower_reply(s, 0)
        r.content["metrics"]["client-id"] = 1
        replies = [r]
    elif which == "unsampled":
        replies = [flower_reply(s, 5)]
    elif which == "repeat":
        replies = [flower_reply(s, 0), flower_reply(s, 0)]
    elif which == "unknown node":
        r = flower_reply(s, 0)
        r.metadata.src_node_id = 999
        replies = [r]
    else:
        s.s.cfg = __import__("dataclasses").replace(s.s.cfg, on_nonfinite="drop")
        d = np.full(s.theta.numel(), 0.01, np.float32)
        d[0] = np.nan
        before = s.theta.clone()
        s.aggregate_train(1, [flower_reply(s, 0, d), flower_reply(s, 1)])
        assert torch.isfinite(s.theta).all() and not torch.equal(before, s.theta)
        return
    with pytest.raises(ValueError, match="node 10|client"):
        s.aggregate_train(1, replies)


# ================================================================================ (2) more paths that held
@pytest.mark.parametrize("scale", ["../x", "smoke/../../x", "/tmp/x", "sm\u00f6ke", "a" * 65, ".hidden", "smoke\n"])
def test_scale_names_from_the_command_line_are_refused(tmp_path, scale):
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "run", "tiny", "--scale", scale])
    one_line_error(rc, err)
    assert not (tmp_path / "x").exists() and not Path("/tmp/x").exists() or scale != "/tmp/x"


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "../outside.txt", "/etc/passwd"])
def test_result_outputs_that_name_devices_or_outside_files_are_not_read(tmp_path, target):
    from fedlab_nb.repro.runner import _outputs_intact
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "outside.txt").write_text("x")
    if target == "fifo":
        os.mkfifo(results / "pipe")
        name = "pipe"
    else:
        os.symlink(target if target.startswith("/") else tmp_path / "outside.txt", results / "link")
        name = "link"
    assert _outputs_intact({"outputs": {name: "0" * 64, target: "0" * 64}}, results) is False
