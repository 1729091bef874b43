"""Probe 42e: a fifth, independent re-run of issue 42's failure classes with variants that test_reliability3.py,
test_probe42.py, test_probe42c.py and test_probe42d.py do not try. Each test asserts the correct behaviour; a test
marked xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays green until fixed."""
import dataclasses
import fcntl
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.privacy import accounting as A
from test_probe42c import flower_reply
from probes import KW, cli, fed10, finding, one_line_error, root_copy



CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\U000e0000-\U000e007f]")


def no_control(text):
    assert not CONTROL.search(text), repr(text[:300])


GOOD = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced",
        "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "interval": None,
                    "role": "headline"}]}


# ================================================================================ (1) DP rounds and the accountant
@pytest.mark.parametrize("q", [1.4e-6, 4e-7])
def test_fixed_sampling_epsilon_is_not_computed_for_a_smaller_q(q):
    """sampling='fixed' must not round q to a multiple of 1e-6 (a smaller q means a smaller, invalid ε)."""
    try:
        eps = A.epsilon(q, 0.5, 10**5, 1e-5, "rdp", "fixed")
    except ValueError as e:
        assert re.search(r"\bq\b|sampling", str(e)), str(e)
        return
    lower = A.epsilon(1e-6 * int(q / 1e-6), 0.5, 10**5, 1e-5, "rdp", "fixed") if q >= 1e-6 else 0.0
    assert eps > lower, (eps, lower)


@pytest.mark.parametrize("z", [9e99, 1e99, 1e60])
def test_huge_but_allowed_noise_multiplier_gives_a_number(z):
    eps = A.epsilon(0.1, z, 10, 1e-5)
    assert eps >= 0 and eps == eps


@pytest.mark.parametrize("target", [1e-300, 1e-30])
def test_noise_for_a_tiny_epsilon_is_a_number_or_a_named_error(target):
    try:
        z = A.noise_for_epsilon(target, 0.1, 10, 1e-5)
    except ValueError as e:
        assert "target_epsilon" in str(e), str(e)
    else:
        assert np.isfinite(z) and z > 0 and A.epsilon(0.1, z, 10, 1e-5) <= target * (1 + 1e-6)


@pytest.mark.parametrize("kw", [dict(delta=np.float32(1e-5)), dict(q=np.float16(0.1))])
def test_numpy_small_floats_accepted(kw):
    args = {"q": 0.1, "noise_multiplier": 1.0, "steps": 5, "delta": 1e-5, **kw}
    assert A.epsilon(**args) > 0


def test_decimal_parameter_is_a_named_error():
    from decimal import Decimal
    with pytest.raises((TypeError, ValueError), match="noise_multiplier"):
        A.epsilon(0.1, Decimal("1.0"), 5, 1e-5)


def test_local_dp_negative_zero_noise_reports_inf():
    """z = -0.0 is no noise: ε must be inf, not a finite number."""
    from fedlab_nb.methods.privacy.dp import local_epsilon
    assert local_epsilon(-0.0, 3, 1e-5) == float("inf")


def test_secondary_entry_nan_in_simulate_is_caught(fed10):
    """SCAFFOLD's control-variate entry (delta_c) NaN: the run must raise naming the client, not carry NaN in c."""
    from fedlab_nb.core.messages import Transform

    @dataclasses.dataclass
    class NaNc(Transform):
        def __call__(self, msgs, cstate, ctx):
            if "delta_c" in msgs.tensors:
                t = msgs["delta_c"].clone()
                t[0, 0] = float("nan")
                msgs.tensors["delta_c"] = t
            return msgs, cstate
    method = fl.get_method("scaffold")
    method = dataclasses.replace(method, uplink=(*method.uplink, NaNc()))
    try:
        h = fl.simulate(method, fed10, rounds=2, clients_per_round=3, seed=0, **KW)
    except Exception as e:  # noqa: BLE001 -- it must be round 1's reply that is named, not round 2's innocent ones
        assert re.search(r"round 1\b.*client", str(e)), str(e)
    else:
        assert torch.isfinite(h.theta).all() and all(
            torch.isfinite(v).all() for v in h.state.get("objective", {}).values() if torch.is_tensor(v))


# ================================================================================ (4) secure aggregation
@pytest.mark.parametrize("sizes", [(10, -5, 10), (10, 2**62, 10)])
def test_secure_aggregation_bad_client_sizes_are_a_named_error(sizes):
    from fedlab_nb.core.messages import Messages
    from fedlab_nb.methods.privacy.secure_aggregation import SecureAggregation
    ctx = SimpleNamespace(generator=torch.Generator().manual_seed(0), on_nonfinite="raise")
    with pytest.raises(ValueError, match="client_sizes|client 1|bits"):
        t = SecureAggregation(threshold=2, client_sizes=sizes)
        t(Messages({"delta": torch.full((3, 4), 0.1)}, np.array([0, 1, 2])), {}, ctx)


def test_secagg_server_roster_with_unknown_sender_in_shares_aborts():
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort, SecAggClient, SecAggParams, SecAggServer
    n, t, m = 4, 3, 5
    params = SecAggParams(t, m, 32)
    x = np.arange(n * m, dtype=np.int64).reshape(n, m)
    clients = {u: SecAggClient(u, x[u], params, np.random.default_rng(u)) for u in range(n)}
    server = SecAggServer(params, range(n))
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    shares = {u: c.share_keys(roster) for u, c in clients.items()}
    shares[1] = shares[1][:32]  # the commitment only, no share records
    with pytest.raises(SecAggAbort, match="client 1"):
        server.collect_shares(shares)


# ================================================================================ (5) Flower adapter
def strategy(fed, method="fedavg", sampled=(0, 1, 2)):
    pytest.importorskip("flwr")
    from fedlab_nb.engine.server import downlink
    from fedlab_nb.flower import MethodStrategy, _setup
    s = MethodStrategy(_setup(method, fed, "logreg", rounds=1, clients_per_round=3))
    s.nodes, s.sampled, s._t0 = {k: 100 + k for k in range(fed.num_clients)}, np.array(sampled), 0.0
    s.down, s.state, s.theta_bytes = downlink(s.s.round, 0, s.state, s.s.method.broadcast(s.state, s.theta))
    return s


def test_flower_single_reply_with_an_extra_entry_is_refused(fed10):
    from flwr.app import Array
    s = strategy(fed10, sampled=(0,))
    r = flower_reply(s, 0)
    r.content["message"]["extra"] = Array(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="client 0"):
        s.aggregate_train(1, [r])


def test_flower_all_replies_with_the_same_extra_entry_are_refused(fed10):
    from flwr.app import Array
    s = strategy(fed10)
    replies = [flower_reply(s, k) for k in (0, 1, 2)]
    for r in replies:
        r.content["message"]["extra"] = Array(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="client"):
        s.aggregate_train(1, replies)


def scaffold_reply(s, k, dc=None):
    from flwr.app import Array
    r = flower_reply(s, k)
    d = s.theta.numel()
    r.content["message"]["delta_c"] = Array(np.full(d, 0.01, np.float32) if dc is None else dc)
    return r


@pytest.mark.parametrize("which", ["nan", "inf", "short"])
def test_flower_scaffold_control_variate_entry_is_checked(fed10, which):
    s = strategy(fed10, "scaffold")
    d = s.theta.numel()
    dc = np.full(d, 0.01, np.float32)
    if which == "nan":
        dc[3] = np.nan
    elif which == "inf":
        dc[3] = np.inf
    else:
        dc = dc[:-1]
    replies = [scaffold_reply(s, 0, dc), scaffold_reply(s, 1), scaffold_reply(s, 2)] if which != "short" else \
        [scaffold_reply(s, k, dc) for k in (0, 1, 2)]  # every reply short: nothing disagrees
    try:
        s.aggregate_train(1, replies)
    except ValueError as e:
        assert "client 0" in str(e) or which == "short" and "client" in str(e), str(e)
    else:
        state_tensors = [v for v in s.state.get("objective", {}).values() if torch.is_tensor(v)]
        assert torch.isfinite(s.theta).all() and all(torch.isfinite(v).all() for v in state_tensors), \
            "a non-finite control variate was accepted into the server state"


# ================================================================================ (2)/(6) the run lock's holder text
@pytest.mark.parametrize("body", ['{"pid": 1e999, "host": "h", "scale": "s", "started": "t"}',
                                  '{"pid": Infinity, "host": "h", "scale": "s", "started": "t"}',
                                  "[" * 2000 + "]" * 2000],
                         ids=["pid 1e999", "pid Infinity", "deep"])
def test_a_held_lock_with_a_hostile_holder_text_is_one_line(tmp_path, body):
    root, res = root_copy(tmp_path), tmp_path / "res"
    res.mkdir()
    lock = res / "tiny.lock"
    lock.write_text(body)
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, out, err = cli(["--root", root, "--results", res, "reproduce", "tiny"])
    finally:
        os.close(fd)
    assert rc == 1 and "another run" in err and "Traceback" not in err, (rc, err)


# ================================================================================ (3) result files as hostile input
@pytest.mark.parametrize("metrics", [["other"], "other", 5], ids=["list", "str", "int"])
def test_report_survives_metrics_of_the_wrong_type(tmp_path, metrics):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    claim = {**GOOD["claims"][0], "expect": "> other"}
    (results / "tiny-smoke.json").write_text(json.dumps({**GOOD, "claims": [claim], "metrics": metrics}))
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert rc == 0 and (results / "index.html").is_file(), (rc, err)


@pytest.mark.parametrize("where", ["report ours", "metric list"])
def test_report_survives_a_huge_integer_in_a_list(tmp_path, where):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    big = "1" + "0" * 400
    if where == "report ours":
        text = json.dumps({**GOOD, "report": [{"id": "r", "metric": "m", "ours": [0, 0]}]}).replace("[0, 0]", f"[{big}, 1.0]")
    else:
        claim = {**GOOD["claims"][0], "expect": "> other"}
        text = json.dumps({**GOOD, "claims": [claim], "metrics": {"other": [0, 0]}}).replace("[0, 0]", f"[{big}, 1.0]")
    (results / "tiny-smoke.json").write_text(text)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert rc == 0 and (results / "index.html").is_file(), (rc, err)


@pytest.mark.parametrize("interval", [
    {"mean": 0.5, "half_width": 0.1, "n": 1e308, "confidence": 0.9},
    {"mean": 0.5, "half_width": 0.1, "n": 5, "confidence": 1e308},
    {"mean": 0.5, "half_width": 0.1, "n": 5, "confidence": 0.9, "margin": {"mean": 1e308, "half_width": -1e308}},
], ids=["n huge", "confidence huge", "margin extreme"])
def test_list_claims_survives_extreme_interval_numbers(tmp_path, interval):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    claim = {**GOOD["claims"][0], "interval": interval}
    (results / "tiny-smoke.json").write_text(json.dumps({**GOOD, "claims": [claim]}))
    for cmd in (["list", "--claims"], ["report"]):
        rc, out, err = cli(["--root", root, "--results", results] + cmd)
        assert rc in (0, 1) and not str(rc).startswith("raised") and "Traceback" not in err, (cmd, rc, err)


# ================================================================================ (7) CLI input
def test_p_integer_too_large_for_a_float_parameter_is_one_line(tmp_path):
    root = root_copy(tmp_path, lambda t: t.replace("parameters: {n_points: 4}", "parameters: {}"))  # -p order first
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny",
                        "-p", "value", "1" + "0" * 400, "-p", "n_points", "abc"])
    one_line_error(rc, err)
    assert "value" in err or "n_points" in err


def test_claims_file_integer_too_large_for_a_float_parameter_is_one_line(tmp_path):
    root = root_copy(tmp_path, lambda t: t.replace("parameters: {n_points: 4}", "parameters: {value: 1" + "0" * 400 + "}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny", "-p", "n_points", "abc"])
    one_line_error(rc, err)


@pytest.mark.parametrize("break_it", ["not json", "not utf-8"])
def test_lab_student_with_an_unreadable_notebook_is_one_line(tmp_path, break_it):
    root = root_copy(tmp_path)
    bad = root / "notebooks" / "broken.ipynb"
    bad.write_bytes(b"{not json" if break_it == "not json" else b"\xff\xfe{}")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "lab", "--student", "--dry-run"])
    one_line_error(rc, err)
    assert "broken.ipynb" in err


def test_lab_fresh_with_a_folder_where_a_copy_goes_is_one_line(tmp_path):
    root, res = root_copy(tmp_path), tmp_path / "res"
    (res / "lab" / "tiny.ipynb").mkdir(parents=True)
    rc, out, err = cli(["--root", root, "--results", res, "lab", "--fresh", "--dry-run"])
    one_line_error(rc, err)
    assert "tiny.ipynb" in err


def test_results_folder_unreadable_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads anything")
    root, res = root_copy(tmp_path), tmp_path / "res"
    res.mkdir()
    (res / "tiny-smoke.json").write_text(json.dumps(GOOD))
    os.chmod(res, 0o300)  # writable, not listable
    try:
        rc, out, err = cli(["--root", root, "--results", res, "list"])
    finally:
        os.chmod(res, 0o755)
    assert rc in (0, 1) and not str(rc).startswith("raised") and "Traceback" not in err, (rc, err)


# ================================================================================ (2)/(3)/(8) figures: files as input
def figures_setup(tmp_path, reference: bytes | str, data=None):
    root = root_copy(tmp_path)
    (root / "papers" / "figures").mkdir()
    ref = root / "papers" / "figures" / "tiny.json"
    ref.write_bytes(reference.encode() if isinstance(reference, str) else reference)
    run = tmp_path / "run"
    run.mkdir()
    payload = data if data is not None else {"cpu": "x86", "series": [{"key": "k", "values": [1.0]}]}
    (run / "main.data.json").write_text(json.dumps(payload))
    return root, run


def test_figures_check_does_not_print_control_characters_from_the_reference(tmp_path):
    ref = {"cpu": "\x1b]0;pwn\x07arm\x1b[2J", "figures": {"main": {"series": [{"key": "k\x1b[31m", "values": [2.0]}]}}}
    root, run = figures_setup(tmp_path, json.dumps(ref),
                              {"cpu": "x86", "series": [{"key": "k\x1b[31m", "values": [1.0]}]})
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "figures", "check", "tiny", "--from", run])
    assert rc == 1, (rc, out, err)
    no_control(out + err)


@pytest.mark.parametrize("reference", [b"\xff\xfe{}", b"[" * 100000, b'{"figures": {"main": {"series": 5}}}',
                                       ],
                         ids=["not utf-8", "deep", "series int"])
def test_figures_check_with_a_corrupt_reference_is_one_line(tmp_path, reference):
    root, run = figures_setup(tmp_path, reference)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "figures", "check", "tiny", "--from", run])
    one_line_error(rc, err)
    assert "tiny.json" in err


def test_figures_check_with_a_corrupt_run_file_is_one_line(tmp_path):
    root, run = figures_setup(tmp_path, json.dumps({"figures": {"main": {"series": [{"key": "k", "values": [1.0]}]}}}))
    (run / "main.data.json").write_bytes(b"\xff\xfe{}")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "figures", "check", "tiny", "--from", run])
    one_line_error(rc, err)


def test_figures_check_does_not_hang_on_a_fifo(tmp_path):
    import threading
    from fedlab_nb.repro import figures as F
    root, run = figures_setup(tmp_path, json.dumps({"figures": {"main": {"series": [{"key": "k", "values": [1.0]}]}}}))
    os.mkfifo(run / "pipe.data.json")
    outcome = []

    def read():
        try:
            outcome.append(F.run_figures(run))
        except Exception as e:  # noqa: BLE001
            outcome.append(e)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    blocked = t.is_alive()
    if blocked:  # unblock the reader: a writer that writes nothing
        os.close(os.open(run / "pipe.data.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not blocked, "figures.run_figures blocked on pipe.data.json (a FIFO) for 5 s"


def test_figures_update_does_not_write_through_a_symlink(tmp_path):
    root, run = figures_setup(tmp_path, json.dumps({"figures": {}}))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    ref = root / "papers" / "figures" / "tiny.json"
    ref.unlink()
    ref.symlink_to(victim)
    cli(["--root", root, "--results", tmp_path / "res", "figures", "update", "tiny", "--from", run])
    assert victim.read_text() == "precious"


# ================================================================================ (8) control characters
@pytest.mark.parametrize("char", ["\u061c", "\u2066", "\u200e"], ids=["arabic letter mark", "LRI", "LRM"])
def test_list_strips_format_and_separator_characters(tmp_path, char):
    root = root_copy(tmp_path, lambda t: t.replace('method: "Tiny — harness fixture"',
                                                  f"method: {json.dumps('Tiny ' + char + 'x')}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert rc == 0, err
    assert char not in out + err, repr(out[:200])


# ================================================================================ (2)/(6) paths and killed runs
def test_staging_does_not_delete_through_a_leftover_link(tmp_path):
    from fedlab_nb.repro.files import staging
    out, target = tmp_path / "results", tmp_path / "elsewhere"
    out.mkdir()
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    (out / ".tiny-smoke.abc.running").symlink_to(target)
    with staging(out, "tiny-smoke"):
        pass
    assert (target / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_report_with_a_folder_where_it_writes_is_one_line(tmp_path, name):
    root, results = root_copy(tmp_path), tmp_path / "results"
    (results / name).mkdir(parents=True)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    one_line_error(rc, err)
    assert name in err


def test_params_refuses_a_notebook_folder_linked_outside(tmp_path):
    root = root_copy(tmp_path)
    outside = tmp_path / "outside"
    (root / "notebooks").rename(outside)
    (root / "notebooks").symlink_to(outside)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    one_line_error(rc, err)
    assert "outside" in err


def test_lab_refuses_a_lab_folder_that_is_a_link(tmp_path):
    root, res, target = root_copy(tmp_path), tmp_path / "res", tmp_path / "elsewhere"
    res.mkdir()
    target.mkdir()
    (res / "lab").symlink_to(target)
    rc, out, err = cli(["--root", root, "--results", res, "lab", "--dry-run"])
    one_line_error(rc, err)
    assert list(target.iterdir()) == []
