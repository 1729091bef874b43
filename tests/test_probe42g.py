"""Probe 42g: a seventh, independent re-run of issue 42's failure classes, with variants that test_reliability3.py
and test_probe42*.py do not try, and the public APIs new since the sixth (AFL, qffl(loss_on=...), load_adult's
group_by / features, studies.grid / studies.product). Each test asserts the correct behaviour; a test marked
xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays green until it is fixed.
The two "known" tests are the sixth re-probe's open LOW items."""
import dataclasses
import json
import os
import threading

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb import studies
from fedlab_nb.core.messages import Messages
from fedlab_nb.methods.heterogeneity.agnostic_fl import AgnosticRule, agnostic_fl, project_simplex
from fedlab_nb.methods.heterogeneity.qffl import qffl
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg
from probes import KW, cli, declared, fed10, one_line_error, root_copy


def F(n, why):
    return pytest.mark.xfail(strict=True, reason=f"finding {n}: {why}")


def KNOWN(why):
    return pytest.mark.xfail(strict=True, reason=f"known (probe 42f, LOW): {why}")


# ================================================================================ AFL and q-FFL (new public APIs)
@pytest.mark.parametrize("clients_per_round", [0.3, 2], ids=["30 %", "2 of 10"])
def test_afl_with_partial_participation_keeps_theta_finite(fed10, clients_per_round):
    """The projection sets most λ_k to 0; a round whose sampled clients all have λ_k = 0 divided 0 by 0."""
    h = fl.simulate(agnostic_fl(), fed10, rounds=10, clients_per_round=clients_per_round, seed=0, **KW)
    lam = h.state["rule"]["lambda"]
    assert torch.isfinite(h.theta).all() and torch.isfinite(h.state["rule"]["average"]).all()
    assert torch.isfinite(lam).all() and abs(float(lam.sum()) - 1) < 1e-5


def test_afl_round_whose_sampled_clients_all_have_zero_weight_moves_nothing():
    """Σ_k λ_k Δ_k over the sampled clients is 0 when all their λ_k are 0: no step (and the λ ascent still runs)."""
    rule = AgnosticRule(lr_lambda=0.1)
    theta = torch.zeros(3)
    state = rule.init_state(theta, 4)
    state["lambda"] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    info = dataclasses.make_dataclass("I", ["messages", "client_ids", "theta"])(
        Messages({"delta": torch.ones(2, 3), "loss": torch.tensor([5.0, 1.0])}, np.array([1, 2])),
        np.array([1, 2]), theta)
    agg, new = rule.aggregate(state, torch.ones(2, 3), None, info)
    assert torch.equal(agg, torch.zeros(3)), agg
    assert torch.isfinite(new["lambda"]).all() and float(new["lambda"][1]) > 0


@pytest.mark.parametrize("lr_lambda", [float("inf"), 1e308])
def test_afl_huge_lambda_step_is_a_named_error(fed10, lr_lambda):
    """now: inf accepted; both end in a bare RuntimeError 'max(): Expected reduction dim ...' from the projection."""
    with pytest.raises(ValueError, match="lr_lambda"):
        fl.simulate(agnostic_fl(lr_lambda=lr_lambda), fed10, rounds=1, seed=0, **KW)


def test_project_simplex_refuses_non_finite_input():
    with pytest.raises(ValueError, match="finite"):
        project_simplex(torch.tensor([float("nan"), 1.0]))


@pytest.mark.parametrize("loss_on", ["Data", None, ["data"], "batch "])
def test_afl_and_qffl_refuse_a_bad_loss_on_naming_it(loss_on):  # held
    for build in (agnostic_fl, qffl):
        with pytest.raises(ValueError, match="loss_on"):
            build(loss_on=loss_on)


@pytest.mark.parametrize("kw, name", [(dict(q=float("inf")), "q"), (dict(q=float("nan")), "q"),
                                      (dict(lipschitz=float("inf")), "lipschitz"), (dict(lipschitz=True), "lipschitz"),
                                      (dict(lipschitz="1"), "lipschitz")],
                         ids=["q inf", "q nan", "L inf", "L True", "L str"])
def test_qffl_bad_parameters_are_refused_naming_them(kw, name):
    """now: q = inf / nan and L = inf / True accepted (θ goes NaN in round 1 and round 2's clients are blamed);
    L = '1' is a bare TypeError ('>' not supported)."""
    with pytest.raises(ValueError, match=name):
        qffl(**kw)


def test_a_server_step_that_makes_theta_non_finite_is_named_not_blamed_on_clients(fed10):
    """A rule that returns NaN from finite updates: now θ is released NaN and round 2's honest clients are blamed
    ('client(s) [..] returned a non-finite update ... Lower lr')."""
    method = dataclasses.replace(fl.get_method("fedavg"), rule=lambda u, w: torch.full_like(u[0], float("nan")))
    with pytest.raises(ValueError, match=r"round 1\b.*server") as e:
        fl.simulate(method, fed10, rounds=2, clients_per_round=3, seed=0, **KW)
    assert "client(s)" not in str(e.value)


def test_qffl_huge_q_ends_in_a_named_server_error_not_a_client_blame(fed10):
    """q = 200 is finite, but F_k^q overflows float32: the run must stop in round 1 naming the server step."""
    try:
        h = fl.simulate(qffl(q=200.0), fed10, rounds=2, clients_per_round=3, seed=0, **KW)
    except ValueError as e:
        assert "server" in str(e) and "round 1" in str(e) and "client(s)" not in str(e), str(e)
    else:
        assert torch.isfinite(h.theta).all()


# ================================================================================ load_adult (new parameters)
@pytest.mark.parametrize("kw, name", [(dict(group_by=["sex"]), "group_by"), (dict(min_group_size="x"), "min_group_size"),
                                      (dict(min_group_size=-1), "min_group_size"), (dict(max_train=-5), "max_train"),
                                      (dict(max_train=0), "max_train"), (dict(max_train=1.5), "max_train"),
                                      (dict(max_train="10"), "max_train"), (dict(max_train=10, seed="x"), "seed")],
                         ids=["group_by list", "min_group str", "min_group -1", "max_train -5", "max_train 0",
                              "max_train 1.5", "max_train str", "seed str"])
def test_load_adult_bad_parameters_are_refused_naming_them(kw, name):
    """now: a list group_by is a bare 'unhashable type'; max_train=-5 silently drops 5 rows and 0 gives an empty
    train set; a string min_group_size / max_train is a bare pandas or slice TypeError. Checked before the data."""
    from fedlab_nb.data.natural_data import load_adult
    with pytest.raises(ValueError, match=name):
        load_adult(**kw)


# ================================================================================ studies.grid / product / paired
def _run(seed, **config):
    return {"acc": float(seed)}


@pytest.mark.parametrize("seeds", ["12", [1.9, 2.2], [True, 0], 5, ["a"], [float("nan")]],
                         ids=["str", "floats", "bool", "int", "str list", "nan"])
def test_grid_bad_seeds_are_refused_naming_them(seeds):
    """now: '12' runs seeds 1 and 2, 1.9 becomes seed 1, True seed 1; 5 and 'a' are bare TypeError / int() errors."""
    with pytest.raises(ValueError, match="seeds"):
        studies.grid(_run, [{}], seeds)


@pytest.mark.parametrize("returned", [{"seed": 99, "acc": 1.0}, {"lr": 99.0}], ids=["seed", "config key"])
def test_grid_refuses_a_result_that_overwrites_the_rows_labels(returned):
    """now: the returned value silently replaces the row's seed (or configuration) column: rows are mislabelled
    and paired differences compare the wrong runs."""
    with pytest.raises(ValueError, match=repr(next(iter(returned)))):
        studies.grid(lambda seed, lr: returned, [{"lr": 0.1}], [0])


@pytest.mark.parametrize("args, name", [((_run, {"lr": [0.1]}, [0]), "configs"), ((_run, ["ab"], [0]), "configs"),
                                        ((5, [{}], [0]), "run")],
                         ids=["configs a dict of axes", "configs strings", "run not callable"])
def test_grid_bad_configs_or_run_are_named(args, name):
    """now: bare TypeErrors ('argument after ** must be a mapping, not str', 'int' object is not callable)."""
    with pytest.raises((TypeError, ValueError), match=name):
        studies.grid(*args)


@pytest.mark.parametrize("setup", [lambda s: None, lambda s: [1, 2], {"fed": 1}], ids=["None", "list", "not callable"])
def test_grid_bad_setup_is_named(setup):
    with pytest.raises((TypeError, ValueError), match="setup"):
        studies.grid(_run, [{}], [0], setup=setup)


@pytest.mark.parametrize("call", ["paired metric", "paired by", "paired where", "per_seed metric", "per_seed by"])
def test_paired_and_per_seed_name_an_unknown_column(call):
    """now: bare KeyError 'nope' from pandas."""
    frame = studies.grid(lambda seed, m: {"acc": seed + (m == "a")}, studies.product(m=["a", "b"]), [0, 1])
    with pytest.raises(ValueError, match="'nope'.*acc"):
        if call == "paired metric":
            studies.paired(frame, "nope", by="m", a="a", b="b")
        elif call == "paired by":
            studies.paired(frame, "acc", by="nope", a="a", b="b")
        elif call == "paired where":
            studies.paired(frame, "acc", by="m", a="a", b="b", where={"nope": 1})
        elif call == "per_seed metric":
            studies.per_seed(frame, "nope", "m")
        else:
            studies.per_seed(frame, "acc", "nope")


def test_grid_and_product_accepted_forms_still_work():  # held
    frame = studies.grid(_run, studies.product(lr=(0.1, 0.2)), np.arange(2))
    assert frame["seed"].tolist() == [0, 0, 1, 1] and frame["lr"].tolist() == [0.1, 0.2, 0.1, 0.2]
    assert studies.paired(frame, "acc", by="lr", a=0.2, b=0.1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("seeds", ["12", [1.9, 2.2], [True, False]], ids=["str", "floats", "bools"])
def test_simulate_seeds_refuses_seeds_that_are_not_whole_numbers(fed10, seeds):
    from fedlab_nb.engine.seeds import simulate_seeds
    with pytest.raises(ValueError, match="seeds"):
        simulate_seeds(fl.get_method("fedavg"), fed10, "logreg", seeds=seeds, rounds=1, clients_per_round=2)


# ================================================================================ DP: the sampler the accountant assumes
def test_dp_custom_sampler_that_always_picks_the_same_clients_is_refused(fed10):
    """Binomial(K, q) clients a round, but always the lowest ids: the round sizes look Poisson (the only check of
    a custom sampler), yet client 0 takes part in ~65 % of the rounds, not q = 10 %: the ε reported would not hold."""
    def lowest(r, K, g):
        return np.arange(g.binomial(K, 0.1))
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    with pytest.raises(ValueError, match="client 0"):
        fl.simulate(method, fed10, rounds=40, clients_per_round=declared(lowest, 0.1), seed=0, **KW)


def test_dp_custom_poisson_sampler_still_runs(fed10):  # held: a fair custom sampler is not refused
    def fair(r, K, g):
        return np.flatnonzero(g.random(K) < 0.3)
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3)
    h = fl.simulate(method, fed10, rounds=40, clients_per_round=declared(fair, 0.3), seed=0, **KW)
    assert np.isfinite(h["epsilon"]).all()


def test_dp_fixed_sampling_with_drop_stragglers_runs_or_names_drop_stragglers(fed10):
    """DP with drop_stragglers is supported (test_probe42.py: a round whose stragglers are all dropped is noised);
    with sampling='fixed' the run must then go on (ε holds: dropping after sampling is data-independent) or say
    that drop_stragglers is the cause, not send the user to the sampler they already built with dp_sampler."""
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3,
                                             sampling="fixed")
    try:
        h = fl.simulate(method, fed10, rounds=3, clients_per_round=sampler, seed=0, stragglers=0.5,
                        drop_stragglers=True, **KW)
    except ValueError as e:
        assert "drop_stragglers" in str(e), str(e)
    else:
        assert np.isfinite(h["epsilon"]).all()


@pytest.mark.parametrize("args, name", [((torch.tensor(0.1), 1.0, 5, 1e-5), "q"), ((0.1, np.array(1.0), 5, 1e-5), "noise"),
                                        ((0.1, 1.0, 5.0, 1e-5), "steps"), ((0.1, 1.0, 5, 1e-5, "RDP"), "accountant"),
                                        ((0.1, 1.0, 5, 1e-5, "rdp", None), "sampling")],
                         ids=["q tensor", "z array", "steps 5.0", "accountant RDP", "sampling None"])
def test_accountant_refuses_more_input_types_naming_them(args, name):  # held
    from fedlab_nb.methods.privacy import accounting as A
    with pytest.raises((TypeError, ValueError), match=name):
        A.epsilon(*args)


# ================================================================================ CLI and files
def test_lab_ip_is_checked_and_never_printed_raw(tmp_path):
    """now: any --ip text is accepted and printed raw in the command line (an ESC sequence reaches the terminal)."""
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "lab", "--dry-run",
                        "--ip", "\x1b[2J0.0.0.0"])
    assert rc == 2 and "Traceback" not in err and "\x1b" not in out + err, (rc, err)  # argparse: usage + one line
    assert "--ip" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("ip", ["0.0.0.0", "127.0.0.1", "localhost", "::"])
def test_lab_ip_accepts_addresses(tmp_path, ip):  # held
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "lab", "--dry-run", "--ip", ip])
    assert rc == 0 and f"--ip={ip}" in out, (rc, err)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_history_of_a_special_file_is_one_line_and_does_not_block(tmp_path, kind):  # held
    p = tmp_path / "h.csv"
    os.mkfifo(p) if kind == "fifo" else p.symlink_to("/dev/zero")
    got = []
    t = threading.Thread(target=lambda: got.append(cli(["history", p])), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive() and kind == "fifo":
        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
    assert got, "history blocked"
    rc, out, err = got[0]
    one_line_error(rc, err)


@pytest.mark.parametrize("value", ["!!binary aGVsbG8=", "!!set {a: null}", "2024-01-01"], ids=["binary", "set", "date"])
def test_run_refuses_a_scale_parameter_of_a_yaml_only_type(tmp_path, value):  # held: refused before anything runs
    root = root_copy(tmp_path, lambda t: t.replace("parameters: {n_points: 4}", f"parameters: {{value: {value}}}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny"])
    one_line_error(rc, err)
    assert "value" in err and not (tmp_path / "res" / "runs").exists()


def test_list_strips_an_escape_in_an_unknown_field_name(tmp_path):  # held
    root = root_copy(tmp_path, lambda t: t + '\n"\\e[2Jbad\\x07": 1\n')
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert rc == 1 and "INVALID" in err and "\x1b" not in err and "\x07" not in err, (rc, err)


# ================================================================================ known LOW items from probe 42f
@pytest.mark.parametrize("expect", ["> ١", "within ５ of 1", "> 1e١"])
def test_claims_expectation_with_non_ascii_digits_is_refused_naming_the_claim(tmp_path, expect):
    root = root_copy(tmp_path, lambda t: t.replace('expect: ">= 10"', f'expect: "{expect}"'))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert rc == 1 and "value_huge" in err and "ASCII" in err, (rc, err)
    assert len([line for line in err.splitlines() if "tiny" in line]) == 1, err


@pytest.mark.parametrize("cmd", [["list"], ["params", "zero"], ["run", "zero"]])
def test_a_claims_file_that_is_not_a_regular_file_is_named(tmp_path, cmd):
    root = root_copy(tmp_path)
    (root / "papers" / "zero.yaml").symlink_to("/dev/zero")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res"] + cmd)
    assert rc in (1, 2) and "zero.yaml" in err and "not a regular file" in err and "unknown paper" not in err, (rc, err)
    assert "Traceback" not in err


# ================================================================================ paper-scale store (scripts/paper_scale.py)
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


def _store_module():
    import importlib.util
    from probes import REPO
    spec = importlib.util.spec_from_file_location("paper_scale", REPO / "scripts" / "paper_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def store_setup(tmp_path, figures=(), pid="tiny"):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir(exist_ok=True)
    result = {"paper": "tiny", "scale": "paper", "verdict": "reproduced", "error": None, "figures": list(figures),
              "figure_data": [], "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0"}],
              "parameters": {"value": 2.0}}
    (results / f"{pid}-paper.json").write_text(json.dumps(result))
    return root, results


def test_store_refuses_a_paper_id_that_is_a_path(tmp_path):
    """now: store('../../victim') deletes <root>/victim (rmtree of papers/paper_scale/../../victim)."""
    root, results = store_setup(tmp_path)
    victim = root / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (root / "papers" / "paper_scale").mkdir()  # as in the repository
    (tmp_path / "a" / "b").mkdir(parents=True)
    results = results.rename(tmp_path / "a" / "b" / "results")
    (tmp_path / "a" / "victim-paper.json").write_text((results / "tiny-paper.json").read_text())  # results/../../
    with pytest.raises((SystemExit, ValueError), match="victim"):
        _store_module().store("../../victim", results, root)
    assert (victim / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("where", ["absolute", "dotdot", "link out"])
def test_store_copies_only_figures_inside_the_results_folder(tmp_path, where):
    """A result file names its figures: now any path is copied into papers/paper_scale/ (and then committed)."""
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG + b"secret")
    name = {"absolute": str(secret), "dotdot": "../secret.png", "link out": "tiny-paper/leak.png"}[where]
    root, results = store_setup(tmp_path, [name])
    if where == "link out":
        (results / "tiny-paper").mkdir()
        (results / "tiny-paper" / "leak.png").symlink_to(secret)
    with pytest.raises((SystemExit, ValueError), match="secret.png|leak.png"):
        _store_module().store("tiny", results, root)
    stored = root / "papers" / "paper_scale" / "tiny"
    assert not stored.exists() or not any(b"secret" in p.read_bytes() for p in stored.iterdir())


@pytest.mark.parametrize("what", ["result file", "figures folder"])
def test_store_does_not_write_or_delete_through_a_link_in_papers(tmp_path, what):
    """A cloned repository can hold symbolic links: now papers/paper_scale/tiny.json -> victim is overwritten, and
    a linked papers/paper_scale/tiny/ ends in a bare FileExistsError."""
    root, results = store_setup(tmp_path)
    store = root / "papers" / "paper_scale"
    store.mkdir(parents=True)
    victim = tmp_path / "victim"
    if what == "result file":
        victim.write_text("precious")
        (store / "tiny.json").symlink_to(victim)
    else:
        victim.mkdir()
        (victim / "keep.txt").write_text("precious")
        (store / "tiny").symlink_to(victim)
    with pytest.raises((SystemExit, ValueError), match="link"):
        _store_module().store("tiny", results, root)
    assert (victim.read_text() if what == "result file" else (victim / "keep.txt").read_text()) == "precious"


def test_store_keeps_figures_inside_the_results_folder(tmp_path):  # held: the ordinary case still works
    root, results = store_setup(tmp_path, ["tiny-paper/main.png"])
    (results / "tiny-paper").mkdir()
    (results / "tiny-paper" / "main.png").write_bytes(PNG)
    path = _store_module().store("tiny", results, root)
    assert json.loads(path.read_text())["figures"] == ["tiny/main.png"]
    assert (root / "papers" / "paper_scale" / "tiny" / "main.png").read_bytes() == PNG


# ================================================================================ Flower: the run config
class _GridReached(Exception):
    pass


class _StopGrid:
    def __getattr__(self, name):
        raise _GridReached(name)


def _flower_main(fed, rounds_value):
    from types import SimpleNamespace
    pytest.importorskip("flwr")
    from fedlab_nb.flower import _server_app, _setup
    app = _server_app(_setup("fedavg", fed, "logreg", rounds=2, clients_per_round=2), lambda h: None, 5)
    app._main(_StopGrid(), SimpleNamespace(run_config={"num-server-rounds": rounds_value}))


@pytest.mark.parametrize("value", [1.9, True, 0, -3, "abc", float("nan")])
def test_flower_num_server_rounds_is_checked_naming_it(fed10, value):
    with pytest.raises(ValueError, match="num-server-rounds"):
        _flower_main(fed10, value)


@pytest.mark.parametrize("value", [2, "2"])
def test_flower_num_server_rounds_whole_number_runs(fed10, value):  # held: reaches the grid
    with pytest.raises(_GridReached):
        _flower_main(fed10, value)
