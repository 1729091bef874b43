"""Probe 42: variants of the issue-42 failure classes (reliability and security) that test_reliability3.py does
not cover. A failing test here is a finding; see the report in the commit message / session report."""
import io
import json
import os
import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg, dp_fedavg_with_sampler, local_dp_fedavg
from fedlab_nb.methods.privacy.dp import dp_sampler
from probes import KW, declared, fed10, root_copy

INF, NAN = float("inf"), float("nan")


def cli(args):
    """(exit status, stdout, stderr) of the CLI; a Python exception escaping main() is a finding."""
    from fedlab_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def one_line_error(rc, err):
    assert rc in (1, 2) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def no_control(text):
    assert "\x1b" not in text and "\x07" not in text, repr(text[:300])


# (1) DP: empty rounds release noise, ε finite in every row — variants ------------------------------------------
def theta_trace(method, fed, sampler, rounds, **kw):
    seen = []
    h = fl.simulate(method, fed, rounds=rounds, clients_per_round=sampler, seed=0,
                    callback=lambda r, theta, row: seen.append(theta.clone()), **{**KW, **kw})
    return h, seen


@pytest.mark.parametrize("kw", [dict(estimator="clipped"), dict(accountant="pld"), dict(sampling_rate=0.02),
                                dict(example_cap=50.0)])
def test_dp_variants_noise_every_empty_round(fed10, kw):
    method, sampler = dp_fedavg_with_sampler(fed10, **{"noise_multiplier": 1.0, "clip_norm": 0.5, "sampling_rate": 0.1, **kw})
    h, seen = theta_trace(method, fed10, sampler, 8)
    assert (h["n_sampled"] == 0).any()
    for r in range(1, len(seen)):
        assert not torch.equal(seen[r], seen[r - 1]), f"round {r + 1} released θ without noise"
    assert np.isfinite(h["epsilon"]).all()


def test_dp_custom_sampler_that_returns_nobody_still_noises(fed10):
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    sampler = declared(lambda r, K, g: np.array([3]) if r % 2 else np.array([], dtype=np.int64), 0.1)
    h, seen = theta_trace(method, fed10, sampler, 4)
    assert all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1])) and np.isfinite(h["epsilon"]).all()


def test_dp_dropped_stragglers_round_is_noised(fed10):
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    h, seen = theta_trace(method, fed10, sampler, 4, stragglers=1.0, drop_stragglers=True)
    assert np.isfinite(h["epsilon"]).all()


def test_dp_eval_every_rows_all_have_epsilon(fed10):
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    h, _ = theta_trace(method, fed10, sampler, 6, eval_every=3)
    assert np.isfinite(h["epsilon"]).all() and len(h) == 6


def test_flower_dp_round_without_replies_is_noised(fed10):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import MethodStrategy, _setup
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    s = MethodStrategy(_setup(method, fed10, "logreg", rounds=1, clients_per_round=sampler))
    s.sampled, s._t0, s.down, s.theta_bytes = np.array([], dtype=np.int64), 0.0, {}, 0
    before = s.theta.clone()
    s.aggregate_train(1, [])
    assert not torch.equal(before, s.theta) and np.isfinite(s.rows[-1]["epsilon"])


# (8) DP parameter validation — the parameters the first round left out ----------------------------------------
@pytest.mark.parametrize("build, match", [
    (lambda: dp_fedavg(adaptive=True, clip_count_stddev=INF), "clip_count_stddev"),
    (lambda: dp_fedavg(adaptive=True, clip_count_stddev="1"), "clip_count_stddev"),
    (lambda: dp_fedavg(adaptive=True, clip_count_stddev=True), "clip_count_stddev"),
    (lambda: dp_fedavg(adaptive=True, clip_count_stddev=1.0, target_quantile="0.5"), "target_quantile"),
    (lambda: dp_sampler(NAN, 10), "q"),
    (lambda: dp_sampler("0.1", 10), "q"),
    (lambda: dp_sampler(True, 10), "q"),
])
def test_more_privacy_parameters_are_refused_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        m = build()
        if hasattr(m, "rule"):
            m.rule.init_state(torch.zeros(3), 10)


def test_numpy_numbers_are_accepted_as_privacy_parameters():
    from fedlab_nb.methods.privacy import accounting
    dp_fedavg(sampling_rate=np.float32(0.5))            # refused: "must be in (0, 1]" for 0.5
    accounting.epsilon(0.1, 1.0, np.int64(5), 1e-5)     # refused: "steps must be an int"


# (4) secure aggregation / Flower: finiteness, shapes, dtypes, metrics --------------------------------------------
def test_secure_aggregation_refuses_a_non_finite_update_naming_the_client():
    from fedlab_nb.core.messages import Messages
    from fedlab_nb.methods.privacy.secure_aggregation import SecureAggregation
    t = SecureAggregation(threshold=2)
    d = torch.full((3, 4), 0.1)
    d[1, 2] = float("nan")
    ctx = SimpleNamespace(generator=torch.Generator().manual_seed(0), on_nonfinite="raise")
    with pytest.raises(ValueError, match="client 1"):   # now: NaN quantised to 0, the sum silently wrong
        t(Messages({"delta": d}, np.array([0, 1, 2])), {}, ctx)


def test_secure_aggregation_fixed_point_refuses_infinite_clip():
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    with pytest.raises(ValueError, match="clip"):
        FixedPoint(clip=INF)


def flower_strategy(fed):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import MethodStrategy, _setup
    s = MethodStrategy(_setup("fedavg", fed, "logreg", rounds=1, clients_per_round=3))
    s.nodes, s.sampled, s._t0 = {k: 100 + k for k in range(fed.num_clients)}, np.array([0, 1, 2]), 0.0
    s.down, s.theta_bytes = {"theta": s.theta}, 0
    return s


def flower_reply(s, k, delta=None, **metrics):
    from flwr.app import Array
    delta = np.full(s.theta.numel(), 0.01, np.float32) if delta is None else delta
    metrics = {"client-id": k, "num-examples": 10, "steps": 1, "train-loss": 0.5, "bytes-up": 400, **metrics}
    return SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(src_node_id=100 + k),
                           content={"metrics": metrics, "message": {"delta": Array(delta)}})


@pytest.mark.parametrize("which", ["all short", "one reply short", "2-D", "int64", "complex64",
                                   "num-examples nan", "num-examples negative", "steps inf", "bytes-up inf"])
def test_flower_reply_checked_against_theta_and_finite_metrics(fed10, which):
    s = flower_strategy(fed10)
    d = s.theta.numel()
    delta = {"all short": np.zeros(d - 1, np.float32), "one reply short": np.zeros(d - 1, np.float32),
             "2-D": np.zeros((d, 1), np.float32), "int64": np.zeros(d, np.int64),
             "complex64": np.zeros(d, np.complex64)}.get(which)
    metrics = {"num-examples nan": {"num-examples": NAN}, "num-examples negative": {"num-examples": -10},
               "steps inf": {"steps": INF}, "bytes-up inf": {"bytes-up": INF}}.get(which, {})
    ks = [0, 1] if which == "all short" else [0]
    replies = [flower_reply(s, k, delta, **metrics) for k in ks]
    with pytest.raises(ValueError, match=r"client 0"):
        s.aggregate_train(1, replies)


@pytest.mark.parametrize("claimed", [1.9, "abc", None])  # -1 and 99 end in "no SuperNode holds client(s) [1]": acceptable
def test_flower_connect_refuses_a_bad_client_id_reply(fed10, claimed, monkeypatch):
    import fedlab_nb.flower as F
    s = flower_strategy(fed10)
    monkeypatch.setattr(F, "Message", lambda *a, **k: None)  # no Flower run context here
    s.nodes = {}
    nodes = list(range(100, 110))
    ids = list(range(10))
    ids[1] = claimed

    def reply(n, k):
        return SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(src_node_id=n),
                               content={"metrics": {"client-id": k}})
    grid = SimpleNamespace(get_node_ids=lambda: nodes,
                           send_and_receive=lambda msgs, timeout=None: [reply(n, k) for n, k in zip(nodes, ids)])
    with pytest.raises(ValueError, match="node 101"):
        s._connect(grid)


# (3) no writes through links: REPORT.md / index.html; odd things at the lock file ---------------------------------
@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_report_does_not_write_through_a_link(tmp_path, name):
    root, results, victim = root_copy(tmp_path), tmp_path / "results", tmp_path / "victim.txt"
    results.mkdir()
    victim.write_text("precious")
    (results / name).symlink_to(victim)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert victim.read_text() == "precious"
    assert rc == 1 and f"{name} is a symbolic link" in err


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_a_lock_file_that_is_not_a_file_is_one_line(tmp_path, kind):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "tiny.lock").mkdir() if kind == "dir" else os.mkfifo(results / "tiny.lock")
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny"])  # now: IsADirectoryError / EINVAL
    one_line_error(rc, err)
    assert "tiny.lock" in err


# (3)/(6) claims files: nesting, huge ints, bad tags; notebooks that are not notebooks -----------------------------
@pytest.mark.parametrize("edit", [
    lambda t: t + "note: " + "[" * 20000 + "]" * 20000 + "\n",
    lambda t: t + "note: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
    lambda t: t.replace("seconds: 10", "seconds: " + "9" * 5000),
    lambda t: t.replace("seconds: 10", "seconds: !!float abc"),
    lambda t: t.replace("seconds: 10", "seconds: !!int abc"),
], ids=["deep list", "deep map", "huge int", "bad !!float", "bad !!int"])
def test_a_malformed_claims_file_is_one_line_naming_it(tmp_path, edit):
    root = root_copy(tmp_path, edit)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])  # now: RecursionError / ValueError
    one_line_error(rc, err)
    assert "tiny.yaml" in err
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])  # one bad file must not break list
    assert "INVALID" in err and "Traceback" not in err


@pytest.mark.parametrize("break_it", ["not json", "not utf-8", "syntax error", "claims file as notebook"])
def test_an_unreadable_notebook_is_one_line(tmp_path, break_it):
    edit = (lambda t: t.replace("notebook: notebooks/tiny.ipynb", "notebook: papers/tiny.yaml")) \
        if break_it == "claims file as notebook" else None
    root = root_copy(tmp_path, edit)
    nbp = root / "notebooks" / "tiny.ipynb"
    if break_it == "not json":
        nbp.write_text("{not json")
    elif break_it == "not utf-8":
        nbp.write_bytes(b"\xff\xfe{}")
    elif break_it == "syntax error":
        nb = json.loads(nbp.read_text())
        nb["cells"][1]["source"] = "value = (\n"
        nbp.write_text(json.dumps(nb))
    for cmd in (["params", "tiny"], ["run", "tiny"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res"] + cmd)
        one_line_error(rc, err)


# (6) -p values: huge ints, bad explicit tags, .inf / .nan ------------------------------------------------------------
@pytest.mark.parametrize("value", ["9" * 5000, "!!float abc", "!!int abc", "&a [*a]"])
def test_a_bad_parameter_value_is_one_line(tmp_path, value):
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny", "-p", "value", value])
    one_line_error(rc, err)
    assert "value" in err


@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_an_infinite_parameter_is_refused_or_runs(tmp_path, value):
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny", "-p", "value", value,
                        "-p", "fail", "true"])  # fail=true: the notebook stops at once, nothing slow runs
    # now: ValueError "Out of range float values are not JSON compliant" from parameters.json
    assert "Traceback" not in err and "not JSON compliant" not in err


# (6) corrupt result files: wrong types that report trips on ----------------------------------------------------------
GOOD = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced",
        "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "interval": None, "role": "headline"}]}


@pytest.mark.parametrize("extra", [
    {"counts": 5}, {"counts": {"supporting": 3}}, {"counts": {"supporting": {"reproduced": "x"}}},
    {"claims": [{"id": "a", "verdict": "b", "expect": "c", "role": ["x"]}]}, {"report": [{"text": "no id"}]},
], ids=["counts int", "counts inner int", "counts str", "role list", "report row without id"])
def test_report_survives_wrong_types_in_a_result_file(tmp_path, extra):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(json.dumps({**GOOD, **extra}))
    rc, out, err = cli(["--root", root, "--results", results, "report"])  # now: AttributeError / TypeError / KeyError
    assert rc == 0 and "stale" in (results / "REPORT.md").read_text()


# (7) control characters from files: list / list --claims / params -----------------------------------------------
def test_list_does_not_print_control_characters_from_a_result_file(tmp_path):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    bad = {**GOOD, "verdict": "\x1b[2Jpwned\x07",
           "claims": [{**GOOD["claims"][0], "verdict": "\x1b]0;title\x07x"}]}
    (results / "tiny-smoke.json").write_text(json.dumps(bad))
    for cmd in (["list"], ["list", "--claims"]):
        rc, out, err = cli(["--root", root, "--results", results] + cmd)
        no_control(out + err)


def test_list_and_params_do_not_print_control_characters_from_a_claims_file(tmp_path):
    root = root_copy(tmp_path, lambda t: t.replace('method: "Tiny — harness fixture"',
                                                  'method: "Tiny \\e[2J\\e]0;pwn\\a fixture"')
                     .replace('paper_value: "1.0 (Eq. 2)"', 'paper_value: "1.0 \\e[31m(Eq. 2)"'))
    for cmd in (["list"], ["list", "--claims"], ["params", "tiny"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res"] + cmd)
        assert rc == 0, err
        no_control(out + err)


# (6) history: a CSV with text in a number column ----------------------------------------------------------------------
@pytest.mark.parametrize("cell", ["abc", "\x1b[2Jx"])
def test_history_with_text_in_a_number_column_is_one_line(tmp_path, cell):
    p = tmp_path / "h.csv"
    p.write_text(f"round,train_loss,test_acc\n1,0.5,{cell}\n")
    rc, out, err = cli(["history", p])  # now: ValueError from summary(), outside the try
    one_line_error(rc, err)
    no_control(err)


def test_history_does_not_print_control_characters_from_the_sidecar(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text("round,train_loss,test_acc\n1,0.5,0.9\n")
    (tmp_path / "h.json").write_text(json.dumps({"method": "\x1b[2Jpwn", "dataset": "\x1b]0;t\x07"}))
    rc, out, err = cli(["history", p])
    no_control(out + err)


# (6) the up-to-date shortcut trusts fields read_result never checked --------------------------------------------------
@pytest.mark.notebook
def test_reproduce_skip_path_with_a_tampered_result_is_one_line(tmp_path):
    root, results = root_copy(tmp_path), tmp_path / "results"
    rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny"])
    assert rc == 0, err
    path = results / "tiny-smoke.json"
    good = json.loads(path.read_text())
    for tamper in (lambda d: [c.pop("stored_verdict") for c in d["claims"]],
                   lambda d: [c.update(also_seen=5, stored_verdict="x") for c in d["claims"]],
                   lambda d: d.update(error={"x": 1})):
        d = json.loads(json.dumps(good))
        tamper(d)
        path.write_text(json.dumps(d))
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny"])  # now: KeyError / TypeError
        assert "Traceback" not in err and rc in (0, 1)
