"""Probe 42f: a sixth, independent re-run of issue 42's failure classes with variants that test_reliability3.py and
test_probe42*.py do not try. Each test asserts the correct behaviour; a test marked xfail(strict=True) is an open
finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import json
import os
import re
import struct

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg, dp_fedavg_with_sampler
from probes import KW, cli, fed10, one_line_error, root_copy


def F(n, why):
    return pytest.mark.xfail(strict=True, reason=f"finding {n}: {why}")

GOOD = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced",
        "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "interval": None,
                    "role": "headline"}]}


def encodable(text):
    """What a UTF-8 terminal can print: a lone surrogate ('\\ud800' from a JSON or YAML escape) raises there."""
    text.encode("utf-8")


def result_root(tmp_path, data=None, raw=None):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(raw if raw is not None else json.dumps(data))
    return root, results


# ================================================================================ (1) DP: the sampler the accountant assumes
@pytest.mark.parametrize("clients_per_round", [None, 5, 0.5], ids=["all", "5 of 10", "half"])
def test_dp_fedavg_refuses_a_sampler_its_accountant_does_not_assume(fed10, clients_per_round):
    """q = 0.1 Poisson accounted, but every round samples 5 or 10 of 10: the ε in History would not hold."""
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    with pytest.raises(ValueError, match="Poisson sampling with q=0.1"):
        fl.simulate(method, fed10, rounds=2, clients_per_round=clients_per_round, seed=0, **KW)


def test_dp_fedavg_fixed_refuses_a_poisson_sampler_before_round_one(fed10):
    from fedlab_nb.methods.privacy.dp import dp_sampler
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3, sampling="fixed")
    with pytest.raises(ValueError, match="exactly 3 clients"):
        fl.simulate(method, fed10, rounds=1, clients_per_round=dp_sampler(0.5, 10), seed=0, **KW)


def test_dp_fedavg_with_its_own_sampler_and_q_one_run(fed10):  # held: the accepted forms still run
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3)
    assert np.isfinite(fl.simulate(method, fed10, rounds=2, clients_per_round=sampler, seed=0, **KW)["epsilon"]).all()
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=1.0)  # q = 1: every client, every round
    assert np.isfinite(fl.simulate(method, fed10, rounds=2, seed=0, **KW)["epsilon"]).all()
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3,
                                             sampling="fixed")
    assert np.isfinite(fl.simulate(method, fed10, rounds=2, clients_per_round=sampler, seed=0, **KW)["epsilon"]).all()


def test_flower_dp_refuses_a_sampler_its_accountant_does_not_assume(fed10):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import _setup
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    with pytest.raises(ValueError, match="Poisson sampling with q=0.1"):
        _setup(method, fed10, "logreg", rounds=1, clients_per_round=5)


@pytest.mark.parametrize("server_lr", [float("nan"), float("inf"), -1.0, "1"])
def test_server_lr_is_checked_naming_it(server_lr):
    """now: nan/inf run and blame innocent clients ('client(s) [1, 2] returned a non-finite update'), -1 ascends,
    '1' is a bare TypeError from torch."""
    with pytest.raises(ValueError, match="lr"):
        dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3, server_lr=server_lr)


@pytest.mark.parametrize("kw, name", [(dict(seed=2 ** 70), "seed"), (dict(device="bogus"), "device"),
                                      (dict(store_device="bogus"), "store_device")])
def test_simulate_bad_seed_and_devices_name_the_parameter(fed10, kw, name):
    with pytest.raises(ValueError, match=name):
        fl.simulate("fedavg", fed10, **{**dict(rounds=1, clients_per_round=3, seed=0), **KW, **kw})


def test_federate_bad_seed_names_it():
    with pytest.raises((TypeError, ValueError), match="seed"):
        fl.federate("digits", "iid", n_clients=10, seed="x")


# ================================================================================ (4) secure aggregation
def secagg_run(fed, cpr, **kw):
    from fedlab_nb.methods.privacy.secure_aggregation import secure_fedavg
    return fl.simulate(secure_fedavg(**kw), fed, rounds=2, clients_per_round=cpr, seed=0, **KW)


@pytest.mark.parametrize("cpr, kw", [(1, {}), (3, dict(threshold=5))], ids=["one client", "threshold above m"])
def test_secagg_round_below_the_threshold_aborts(fed10, cpr, kw):
    """A round with fewer clients than t: the protocol aborts (SecAggAbort naming t); now a bare ValueError from
    run_protocol's argument check."""
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    with pytest.raises(SecAggAbort, match="threshold"):
        secagg_run(fed10, cpr, **kw)


def test_secagg_round_below_the_threshold_is_skipped_with_on_abort_skip(fed10):
    h = secagg_run(fed10, 1, on_abort="skip")  # now: ValueError, on_abort='skip' never reached
    assert len(h) == 2 and torch.isfinite(h.theta).all()


@pytest.mark.parametrize("threshold", [0, -3, 1, True, "2"])
def test_secagg_bad_threshold_is_refused_naming_it(threshold):
    """now: 0, -3, 1 and True silently become t = 2; '2' is a bare TypeError at the first round."""
    from fedlab_nb.methods.privacy.secure_aggregation import SecureAggregation
    with pytest.raises(ValueError, match="threshold"):
        SecureAggregation(threshold=threshold)


def test_secagg_bad_dropout_type_is_refused_naming_it():
    from fedlab_nb.methods.privacy.secure_aggregation import SecureAggregation
    with pytest.raises(ValueError, match="dropout"):
        SecureAggregation(dropout="0.1")


def secagg_parties(n=4, t=3, m=4):
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggClient, SecAggParams, SecAggServer
    p = SecAggParams(t, m, 32)
    clients = {u: SecAggClient(u, np.arange(m) + u, p, np.random.default_rng(u)) for u in range(n)}
    server = SecAggServer(p, range(n))
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    return clients, server, roster


@pytest.mark.parametrize("stage", ["masked_input before share_keys", "unmask before masked_input",
                                   "unmask by a client that sent no masked input"])
def test_secagg_client_asked_out_of_order_aborts_naming_itself(stage):
    """now: bare AttributeError ('SecAggClient' object has no attribute '_keys' / '_u2')."""
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    clients, server, roster = secagg_parties()
    with pytest.raises(SecAggAbort, match="client 0"):
        if stage == "masked_input before share_keys":
            clients[0].masked_input(b"")
            return
        inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
        if stage == "unmask before masked_input":
            clients[0].unmask(b"".join(struct.pack("<I", u) for u in range(4)))
            return
        surv = server.collect_masked({u: c.masked_input(inbox[u]) for u, c in clients.items() if u != 0})
        clients[0].unmask(surv)


@pytest.mark.parametrize("kw, name", [(dict(ids=[0.5, 1.7, 2.2]), "ids"), (dict(ids=["a", "b", "c"]), "ids"),
                                      (dict(dropouts=["x"]), "dropouts"), (dict(seed="x"), "seed")],
                         ids=["ids float", "ids str", "dropouts str", "seed str"])
def test_run_protocol_bad_ids_are_refused_naming_them(kw, name):
    """now: float ids are truncated silently (0.5, 1.7, 2.2 -> 0, 1, 2); strings give a bare int() error."""
    from fedlab_nb.methods.privacy.secure_aggregation import run_protocol
    with pytest.raises(ValueError, match=name):
        run_protocol(np.zeros((3, 2), np.int64), 2, **kw)


@pytest.mark.parametrize("build, name", [
    (lambda S: S.SecAggServer(S.SecAggParams(1, 3), range(3)), "threshold"),
    (lambda S: S.SecAggClient(0, np.zeros(3, np.int64), S.SecAggParams(2, 3, 65)), "bits"),
    (lambda S: S.SecAggClient(-1, np.zeros(3, np.int64), S.SecAggParams(2, 3)), "uid"),
    (lambda S: S.SecAggClient(2 ** 32, np.zeros(3, np.int64), S.SecAggParams(2, 3)), "uid"),
    (lambda S: S.SecAggServer(S.SecAggParams(2, 3), [0, 2 ** 40]), "users"),
], ids=["t=1", "bits 65", "uid -1", "uid 2^32", "user 2^40"])
def test_secagg_parties_check_their_parameters(build, name):
    """now: accepted; t = 1 lets the server unmask one user alone, an id outside [0, 2^32) fails later on the wire."""
    from fedlab_nb.methods.privacy import secure_aggregation as S
    with pytest.raises(ValueError, match=name):
        build(S)


# ================================================================================ (3)/(6) result files as input
@pytest.mark.parametrize("claim", [{"role": "bogus"}, {"role": "Headline"}], ids=["bogus", "capitalised"])
def test_report_survives_a_claim_role_it_does_not_know(tmp_path, claim):
    root, results = result_root(tmp_path, {**GOOD, "claims": [{**GOOD["claims"][0], **claim}]})
    rc, out, err = cli(["--root", root, "--results", results, "report"])  # now: KeyError: 'bogus'
    assert rc == 0 and (results / "index.html").is_file(), (rc, err)


@pytest.mark.parametrize("stale", [5, ["x"], {"a": 1}], ids=["int", "list", "dict"])
def test_report_survives_a_stale_field_that_is_not_text(tmp_path, stale):
    root, results = result_root(tmp_path, {**GOOD, "stale": stale})
    rc, out, err = cli(["--root", root, "--results", results, "report"])  # now: AttributeError (html.escape)
    assert rc == 0 and (results / "index.html").is_file(), (rc, err)


@pytest.mark.parametrize("field", ["verdict", "claim id", "method"])
def test_report_and_list_survive_a_lone_surrogate_in_a_result_file(tmp_path, field):
    data = json.loads(json.dumps(GOOD))
    if field == "claim id":
        data["claims"][0]["id"] = "value\ud800"
    else:
        data[field] = "x\ud800"
    root, results = result_root(tmp_path, raw=json.dumps(data))  # json.dumps writes the escape '\\ud800'
    rc, out, err = cli(["--root", root, "--results", results, "report"])  # now: UnicodeEncodeError
    assert rc == 0 and (results / "index.html").is_file(), (rc, err)
    encodable(out + err)
    for cmd in (["list"], ["list", "--claims"]):
        rc, out, err = cli(["--root", root, "--results", results] + cmd)
        encodable(out + err)


@pytest.mark.parametrize("cmd", [["list"], ["list", "--claims"], ["params", "tiny"]])
def test_list_and_params_survive_a_lone_surrogate_in_a_claims_file(tmp_path, cmd):
    root = root_copy(tmp_path, lambda t: t.replace('method: "Tiny — harness fixture"', 'method: "Tiny \\uD800 x"'))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res"] + cmd)
    assert rc == 0, err
    encodable(out + err)  # now: '\ud800' reaches print (a traceback on a UTF-8 terminal)


def test_history_survives_a_lone_surrogate_in_the_sidecar(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text("round,train_loss,test_acc\n1,0.5,0.9\n")
    (tmp_path / "h.json").write_text(json.dumps({"method": "x\ud800"}))
    rc, out, err = cli(["history", p])
    assert rc == 0, err
    encodable(out + err)


@pytest.mark.parametrize("extra", [{"notebook": ["a"]}, {"notebook": 5}, {"figures": "abc", "figure_data": 5},
                                   {"citation": ["x"], "title": 5, "method": ["m"]},
                                   {"claims": [{**GOOD["claims"][0], "setting": ["a"], "paper_value": {"a": 1}}]},
                                   {"report": [{"id": "r", "ours": [1e308, -1e308, 1e308], "metric": [1]}]}],
                         ids=["notebook list", "notebook int", "figures str", "citation list", "setting list",
                              "report ours extreme"])
def test_report_survives_more_wrong_types(tmp_path, extra):  # held
    root, results = result_root(tmp_path, {**GOOD, **extra})
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert rc == 0 and (results / "index.html").is_file(), (rc, err)


@pytest.mark.parametrize("expect", ["(" * 3000 + "1" + ")" * 3000, "> " + "1" * 100000, "< 2 ** 99999999"],
                         ids=["deep", "long number", "huge power"])
def test_report_survives_hostile_expectations_in_a_result_file(tmp_path, expect):  # held
    root, results = result_root(tmp_path, {**GOOD, "claims": [{**GOOD["claims"][0], "expect": expect}]})
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert rc == 0, (rc, err)


# ================================================================================ (2) paths: figures
def figures_run(tmp_path, values):
    run = tmp_path / "run"
    run.mkdir()
    (run / "main.data.json").write_text('{"cpu": "x", "series": [{"key": "k", "values": %s}]}' % values)
    return run


def test_figures_update_does_not_write_through_a_linked_figures_folder(tmp_path):
    root, outside = root_copy(tmp_path), tmp_path / "outside"
    outside.mkdir()
    (root / "papers" / "figures").symlink_to(outside)
    run = figures_run(tmp_path, "[1.0]")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "figures", "update", "tiny", "--from", run])
    assert list(outside.iterdir()) == []  # now: outside/tiny.json written
    one_line_error(rc, err)


@pytest.mark.parametrize("values", ["[NaN, 1.0]", "[Infinity]", "[1e999]"])
def test_figures_update_with_non_finite_data_is_one_line(tmp_path, values):
    root, run = root_copy(tmp_path), figures_run(tmp_path, values)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "figures", "update", "tiny", "--from", run])
    one_line_error(rc, err)  # now: ValueError 'Out of range float values are not JSON compliant' escapes
    assert "main.data.json" in err
    assert not (root / "papers" / "figures" / "tiny.json").exists()


# ================================================================================ (7) CLI input and exit statuses
@pytest.mark.parametrize("name, value, hint", [("scale", "paper", "--scale"), ("device", "bogus", "device")])
def test_p_scale_and_device_are_not_silently_ignored_or_unchecked(tmp_path, name, value, hint):
    """-p scale paper: now silently replaced by --scale smoke; -p device bogus: now skips --device's check."""
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "run", "tiny",
                        "-p", name, value, "-p", "n_points", "abc"])  # n_points abc: refused before anything runs
    one_line_error(rc, err)
    assert hint in err and "n_points" not in err, err


def test_reproduce_runs_a_paper_named_twice_once(tmp_path, monkeypatch):
    import fedlab_nb.cli as F
    calls = []
    monkeypatch.setattr(F, "_reproduce_paper", lambda pid, opts: (calls.append(pid), (pid, 0, [f"{pid} ok"], []))[1])
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "reproduce", "tiny", "tiny",
                        "-j", "1"])
    assert rc == 0 and calls == ["tiny"], calls  # now: twice (with -j 2 the second fails on the first's lock)


@pytest.mark.parametrize("cmd", [["list"], ["report"]])
@pytest.mark.parametrize("where", ["missing", "file"])
def test_a_root_that_is_not_a_folder_is_an_error(tmp_path, cmd, where):
    root = tmp_path / "nope"
    if where == "file":
        root.write_text("x")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res"] + cmd)  # now: exit 0, 'no claims files'
    one_line_error(rc, err)
    assert "nope" in err


# ================================================================================ (2) temporary files next to a target
def test_checkpoint_does_not_write_through_a_link_at_its_temporary_name(tmp_path, fed10):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "ck.pt.tmp").symlink_to(victim)  # a predictable name: anyone who can write the folder plants it
    fl.simulate("fedavg", fed10, rounds=1, clients_per_round=3, seed=0, checkpoint=tmp_path / "ck.pt", **KW)
    assert victim.read_text() == "precious"  # now: the victim holds the checkpoint
    assert not (tmp_path / "ck.pt").is_symlink()


def test_write_json_atomic_does_not_write_through_a_link_at_its_temporary_name(tmp_path):
    from fedlab_nb.repro.recording import write_json_atomic
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f".m.json.{os.getpid()}.tmp").symlink_to(victim)
    write_json_atomic(tmp_path / "m.json", {"a": 1})
    assert victim.read_text() == "precious" and json.loads((tmp_path / "m.json").read_text()) == {"a": 1}


# ================================================================================ (5) Flower: counts are whole numbers
@pytest.mark.parametrize("metrics", [{"num-examples": 10.5}, {"steps": 1.5}, {"bytes-up": 2.5}],
                         ids=["num-examples", "steps", "bytes-up"])
def test_flower_fractional_counts_are_refused_naming_the_client(fed10, metrics):
    from test_probe42c import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    with pytest.raises(ValueError, match="client 0"):  # now: accepted (bytes-up 2.5 counted as 2)
        s.aggregate_train(1, [flower_reply(s, 0, **metrics), flower_reply(s, 1)])


@pytest.mark.parametrize("value", ["", "~", "null"])
def test_an_empty_or_null_p_value_for_a_typed_parameter_is_one_line(tmp_path, value):
    """-p value '' (an unset shell variable) is YAML null: now None is accepted for a float and the notebook fails
    in a later cell; it is refused before anything runs, naming the parameter and its type."""
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "run", "tiny", "-p", "value", value])
    one_line_error(rc, err)
    assert "'value'" in err and "float" in err
