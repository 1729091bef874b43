"""Probe 42j: a tenth, independent re-run of issue 42's failure classes, aimed first at what is new since the
ninth (MaxPool2x2's autograd rules, the checkpoint's data hash, the board's string stripping, from_clients' checks,
`-p` values that are not plain, paper_scale.py store's folder swap, evaluate's test_loss of a custom loss), with
variants test_probe42*.py do not try. Each test asserts the correct behaviour; a test marked xfail(strict=True) is
an open finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.data.federated import FederatedDataset
from probes import KW as RUN
from probes import REPO, cli, fed10, one_line_error, root_copy, script, trace  # noqa: F401 (fed10: a fixture)
from probes import flower_reply, flower_strategy
from probes import numbered_finding as F_  # noqa: F401 (a new finding is marked with it)

KW = dict(rounds=1, local_epochs=1, batch_size=8, lr=0.1, progress=False, seed=0)
CONTROL = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b", "\r")


def pairs(seed=0, n=3):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(n)]


# ================================================================================ (1) DP: more variants
def _stop_at(n):
    def stop(r, theta, row):
        if r == n:
            raise KeyboardInterrupt  # a killed run: rounds 1 … n are in the checkpoint
    return stop


@pytest.mark.parametrize("kw", [dict(estimator="clipped", min_total_weight=2.0), dict(example_cap=50.0),
                                dict(server_lr=0.5), dict(accountant="pld")],
                         ids=["clipped estimator", "example cap", "server lr", "pld"])
def test_dp_other_settings_noise_every_empty_round(fed10, kw):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, **{"noise_multiplier": 1.0, "clip_norm": 0.5,
                                                       "sampling_rate": 0.1, **kw})
    h, seen = trace(method, fed10, sampler, 8)
    assert (h["n_sampled"] == 0).any()
    assert all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1]))
    assert np.isfinite(h["epsilon"]).all() and (np.diff(h["epsilon"]) > 0).all()


def test_dp_adaptive_clip_resumed_mid_run_equals_the_whole_run(fed10, tmp_path):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=0.5, clip_norm=0.5, sampling_rate=0.2,
                                             adaptive=True, clip_count_stddev=1.0)
    whole, _ = trace(method, fed10, sampler, 6)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(method, fed10, rounds=6, clients_per_round=sampler, seed=0, checkpoint=tmp_path / "c.pt",
                    callback=_stop_at(3), **RUN)
    resumed, _ = trace(method, fed10, sampler, 6, checkpoint=tmp_path / "c.pt", resume=True)
    assert torch.equal(resumed.theta, whole.theta)
    assert np.allclose(resumed["epsilon"], whole["epsilon"]) and np.allclose(resumed["clip_norm"], whole["clip_norm"])


def test_dp_fixed_size_sampling_resumed_mid_run_equals_the_whole_run(fed10, tmp_path):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.2,
                                             sampling="fixed")
    whole, _ = trace(method, fed10, sampler, 5)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(method, fed10, rounds=5, clients_per_round=sampler, seed=0, checkpoint=tmp_path / "c.pt",
                    callback=_stop_at(2), **RUN)
    resumed, _ = trace(method, fed10, sampler, 5, checkpoint=tmp_path / "c.pt", resume=True)
    assert torch.equal(resumed.theta, whole.theta) and np.allclose(resumed["epsilon"], whole["epsilon"])


def test_local_dp_resumed_mid_run_reports_the_same_epsilon(fed10, tmp_path):  # held
    method = fl.methods.privacy.dp_fedavg.local_dp_fedavg(noise_multiplier=1.0, clip_norm=0.5)
    whole, _ = trace(method, fed10, 0.3, 6)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(method, fed10, rounds=6, clients_per_round=0.3, seed=0, checkpoint=tmp_path / "c.pt",
                    callback=_stop_at(3), **RUN)
    resumed, _ = trace(method, fed10, 0.3, 6, checkpoint=tmp_path / "c.pt", resume=True)
    assert np.allclose(resumed["epsilon"], whole["epsilon"]) and torch.equal(resumed.theta, whole.theta)


def test_dp_empty_rounds_are_noised_on_the_vmap_backend(fed10):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    h, seen = trace(method, fed10, sampler, 8, backend="vmap")
    assert (h["n_sampled"] == 0).any() and all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1]))
    assert np.isfinite(h["epsilon"]).all()


@pytest.mark.parametrize("kw", [dict(clip_norm=float("nan")), dict(sampling_rate=float("nan")),
                                dict(delta=float("nan")), dict(target_quantile=float("nan"), adaptive=True),
                                dict(clip_count_stddev=float("nan"), adaptive=True),
                                dict(min_total_weight=float("nan"), estimator="clipped"),
                                dict(example_cap=float("nan"))],
                         ids=["clip", "q", "delta", "quantile", "count stddev", "min weight", "example cap"])
def test_dp_nan_parameters_are_refused_naming_them(fed10, kw):
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    name = next(k for k in kw if k != "adaptive" and k != "estimator").replace("example_", "")  # CappedWeighting: cap
    with pytest.raises(ValueError, match=name):
        dp_fedavg_with_sampler(fed10, **{"noise_multiplier": 1.0, "clip_norm": 0.5, "sampling_rate": 0.1, **kw})


# ================================================================================ (new) MaxPool2x2
def _pool_pair():
    from fedlab_nb.models import MaxPool2x2
    return MaxPool2x2(), nn.MaxPool2d(2)


@pytest.mark.parametrize("case", ["odd 5x7", "channels-last", "strided view", "expanded batch", "empty batch",
                                  "int64", "uint8", "bfloat16", "all -inf"])
def test_maxpool_equals_torch_on_odd_inputs(case):  # held
    g = torch.Generator().manual_seed(0)
    x = {"odd 5x7": lambda: torch.randn(2, 3, 5, 7, generator=g),
         "channels-last": lambda: torch.randn(2, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last),
         "strided view": lambda: torch.randn(2, 3, 12, 12, generator=g)[:, :, ::2, ::2],
         "expanded batch": lambda: torch.randn(1, 3, 4, 4, generator=g).expand(5, 3, 4, 4),
         "empty batch": lambda: torch.randn(0, 3, 4, 4),
         "int64": lambda: torch.randint(0, 9, (2, 3, 4, 4), generator=g),
         "uint8": lambda: torch.randint(0, 9, (2, 3, 4, 4), generator=g, dtype=torch.uint8),
         "bfloat16": lambda: torch.randn(2, 3, 4, 4, generator=g).bfloat16(),
         "all -inf": lambda: torch.full((1, 1, 4, 4), float("-inf"))}[case]()
    ours, ref = _pool_pair()
    assert torch.equal(ours(x), ref(x))


def test_maxpool_gradients_through_views_and_odd_grad_outputs():  # held
    ours, ref = _pool_pair()
    base = torch.randn(1, 3, 5, 5, requires_grad=True)
    grad_out = torch.randn(3, 5, 2, 2).transpose(0, 1)  # a non-contiguous upstream gradient
    g1, = torch.autograd.grad(ours(base.expand(5, 3, 5, 5)), base, grad_out)
    g2, = torch.autograd.grad(ref(base.expand(5, 3, 5, 5)), base, grad_out)
    assert torch.equal(g1, g2)
    x = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ours, (x,)) and torch.autograd.gradgradcheck(ours, (x,))


def test_maxpool_under_torch_func_transforms():  # held: nested vmap, vmap over tangents only, jacrev, hessian
    from torch.func import hessian, jacrev, jvp, vmap
    ours, ref = _pool_pair()
    g = torch.Generator().manual_seed(1)
    y = torch.randn(2, 3, 2, 3, 4, 4, generator=g)
    assert torch.equal(vmap(vmap(ours))(y), vmap(vmap(ref))(y))
    x, ts = torch.randn(2, 3, 6, 6, generator=g), torch.randn(4, 2, 3, 6, 6, generator=g)
    assert torch.equal(vmap(lambda t: jvp(ours, (x,), (t,))[1])(ts), vmap(lambda t: jvp(ref, (x,), (t,))[1])(ts))
    assert torch.equal(vmap(ours, in_dims=1)(ts), vmap(ref, in_dims=1)(ts))
    small = torch.randn(1, 1, 4, 4, dtype=torch.float64, generator=g)
    assert torch.equal(jacrev(ours)(small), jacrev(ref)(small))
    f = lambda m: (lambda z: m(z).pow(3).sum())  # noqa: E731
    assert torch.equal(hessian(f(ours))(small), hessian(f(ref))(small))


def test_maxpool_detects_an_in_place_change_of_its_input():  # held: the saved input's version is checked
    ours, _ = _pool_pair()
    x = torch.randn(1, 1, 4, 4, requires_grad=True)
    z = x * 1
    out = ours(z)
    z.add_(1)
    with pytest.raises(RuntimeError, match="inplace|modified"):
        out.sum().backward()


# ================================================================================ (new) the checkpoint's data hash
@pytest.mark.parametrize("where", ["global test set", "a client's test rows"])
def test_resume_on_data_that_differs_only_in_test_rows_is_refused(tmp_path, where):  # held
    def fed(shift):
        f = FederatedDataset.from_clients(pairs(0), test=(pairs(9, 1)[0][0] + shift, pairs(9, 1)[0][1]))
        if where == "a client's test rows" and shift:
            f.client_test[0] = (f.client_test[0][0] + shift, f.client_test[0][1])
            f.x_test = f.x_test - shift
        return f
    run = dict(local_epochs=1, batch_size=8, lr=0.1, progress=False, seed=0, checkpoint=tmp_path / "c.pt", rounds=3)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate("fedavg", fed(0.0), "logreg", callback=_stop_at(1), **run)
    with pytest.raises(ValueError, match="other data"):
        fl.simulate("fedavg", fed(1.0), "logreg", resume=True, **run)


# ================================================================================ (new) from_clients
def test_from_clients_uint64_ids_beyond_int64_name_the_labels():
    """Class ids of 2^63 and up (a uint64 hash column) are named as labels out of range, not reported as
    'num_classes must be a positive integer, got -9223372036854775805', a count the user never gave."""
    x = np.zeros((3, 5), np.float32)
    with pytest.raises(ValueError) as e:
        FederatedDataset.from_clients([(x, np.array([0, 1, 2], np.uint64) + np.uint64(2 ** 63))])
    assert "-922" not in str(e.value), str(e.value)


@pytest.mark.parametrize("case", ["x int", "x float16", "x float64 1e300"])
def test_from_clients_rows_of_another_dtype_fail_at_simulate_with_a_named_error(case):  # held
    x = np.random.default_rng(0).normal(size=(10, 5))
    x = {"x int": x.astype(np.int64), "x float16": x.astype(np.float16),
         "x float64 1e300": np.full((10, 5), 1e300)}[case]
    fed = FederatedDataset.from_clients([(x, np.arange(10) % 3)] * 2)
    with pytest.raises(ValueError, match="dtype"):
        fl.simulate("fedavg", fed, "logreg", **KW)


def test_from_clients_refuses_rows_with_no_features():
    """x of shape [n, 0] (a column selection that kept nothing) trains a bias-only model silently."""
    x = np.zeros((10, 0), np.float32)
    with pytest.raises(ValueError, match=r"\bx\b|feature|empty"):
        FederatedDataset.from_clients([(x, np.arange(10) % 3)] * 2)


# ================================================================================ (new) the loss check / test_loss
_W = torch.linspace(0.5, 2.0, 10)


def _weighted_ce(outputs, y, reduction="mean"):
    return F.cross_entropy(outputs, y, weight=_W, reduction=reduction)


def test_class_weighted_cross_entropy_is_refused_naming_its_mean():  # finding 3, fixed as a message
    """F.cross_entropy(weight=w)'s 'mean' is Σ w·l / Σ w, not the mean of its 'none' rows, which the engine
    averages itself (vmap trains on 'none'): it stays refused, with a message that says so, not as a loss that
    'does not honour reduction='."""
    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    with pytest.raises(ValueError, match=r"(?s)'mean'.*not the mean of its 'none' values.*weight") as e:
        fl.simulate("fedavg", fed, "logreg", loss=_weighted_ce, **KW)
    assert "does not honour" not in str(e.value)


# ================================================================================ (2) relative paths everywhere
def _no_traceback(rc, err):
    assert rc == 0 and "Traceback" not in err and "raised" not in str(rc), (rc, err)


@pytest.mark.parametrize("cmd", [["list"], ["list", "--claims"], ["params", "tiny"], ["report"],
                                 ["lab", "--dry-run"], ["lab", "--student", "--dry-run"]])
def test_relative_root_and_results_work_for_every_subcommand(tmp_path, monkeypatch, cmd):  # held
    root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["--root", "root", "--results", "./x/../res", *cmd])
    _no_traceback(rc, err)
    if cmd[0] in ("report", "lab"):
        assert (tmp_path / "res").is_dir() and not (tmp_path / "root" / "res").exists()


def test_relative_root_env_is_the_callers(tmp_path, monkeypatch):  # held
    root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLAB_NB_ROOT", "root")
    monkeypatch.delenv("FEDLAB_NB_RESULTS", raising=False)
    rc, out, err = cli(["report"])
    _no_traceback(rc, err)
    assert (tmp_path / "root" / "results" / "REPORT.md").is_file()


def test_figures_check_with_a_relative_from_folder(tmp_path, monkeypatch):  # held: no reference is one line
    root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    rc, out, err = cli(["--root", "root", "figures", "check", "tiny", "--from", "runs"])
    assert rc in (0, 1, 2) and "Traceback" not in err and "raised" not in str(rc), (rc, err)


def test_history_with_a_relative_path(tmp_path, monkeypatch):  # held
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.csv").write_text("round,train_loss,test_acc\n1,0.5,0.9\n")
    rc, out, err = cli(["history", "h.csv"])
    _no_traceback(rc, err)


# ================================================================================ (3) links inside results
def test_lab_student_folder_that_is_a_link_is_refused(tmp_path):  # held
    root, elsewhere = root_copy(tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "res" / "lab").mkdir(parents=True)
    (tmp_path / "res" / "lab" / "student").symlink_to(elsewhere)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "lab", "--student", "--dry-run"])
    assert rc != 0 and list(elsewhere.iterdir()) == [], (rc, err)


def test_lab_student_notebook_that_is_a_link_is_not_written_through(tmp_path):  # held
    root, victim = root_copy(tmp_path), tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "res" / "lab" / "student").mkdir(parents=True)
    (tmp_path / "res" / "lab" / "student" / "tiny.ipynb").symlink_to(victim)
    cli(["--root", root, "--results", tmp_path / "res", "lab", "--student", "--dry-run", "--fresh"])
    assert victim.read_text() == "precious"


def test_report_with_a_result_file_that_links_outside_does_not_write_there(tmp_path):  # held
    root, results, outside = root_copy(tmp_path), tmp_path / "results", tmp_path / "outside.json"
    results.mkdir()
    outside.write_text(json.dumps({"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "claims": []}))
    (results / "tiny-smoke.json").symlink_to(outside)
    before = outside.read_text()
    cli(["--root", root, "--results", results, "report"])
    assert outside.read_text() == before


# ================================================================================ (4) paths and sizes from files
@pytest.mark.parametrize("notebook", ["notebooks/tiny.ipynb\\0",
                                      "notebooks/" + "n" * 300 + ".ipynb",
                                      "notebooks/./../notebooks/tiny.ipynb", "~/tiny.ipynb",
                                      "notebooks/\\u202etiny.ipynb"],
                         ids=["NUL", "name too long", "dot-dot back in", "tilde", "bidi"])
def test_claims_notebook_field_variants_are_one_line(tmp_path, notebook):
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb", f'notebook: "{notebook}"'))
    for cmd in (["params", "tiny"], ["list"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
        assert "Traceback" not in err and "raised" not in str(rc), (cmd, rc, err)
        assert not any(c in out + err for c in CONTROL), (cmd, out + err)


def _alias_bomb(key):
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"] + \
        [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
    return lambda t: t.replace("sources: [\"none: a fixture of the test suite\"]",
                               f"sources: [{', '.join(levels)}]") if key == "sources" else \
        t.replace("setting: {paper: \"none\", ours: \"n_points points\"}",
                  "setting: {paper: [" + ", ".join(levels) + "], ours: \"n\"}")


@pytest.mark.parametrize("key", ["sources", "claim setting"])
def test_an_alias_bomb_outside_parameters_is_refused_quickly(tmp_path, key):  # held
    import time
    root = root_copy(tmp_path, _alias_bomb(key))
    t0 = time.perf_counter()
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert time.perf_counter() - t0 < 5 and "Traceback" not in err and "raised" not in str(rc), (rc, err[:300])


def test_a_deeply_nested_claims_value_is_one_line(tmp_path):  # held
    root = root_copy(tmp_path, lambda t: t.replace('sources: ["none: a fixture of the test suite"]',
                                                   "sources: " + "[" * 5000 + "]" * 5000))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert "Traceback" not in err and "raised" not in str(rc) and "RecursionError" not in err, (rc, err[:300])


# ================================================================================ (5) control characters
def test_params_does_not_print_control_characters_from_the_notebook(tmp_path):
    root = root_copy(tmp_path)
    nbp = root / "notebooks" / "tiny.ipynb"
    nb = json.loads(nbp.read_text())
    nb["cells"][1]["source"] = ('scale = "smoke"\nseed = 0\ndevice = "cpu"\nvalue = 0.5  # \x1b]0;pwn\x07 \u202e\n'
                                'n_points = 3\nfail = False\nlabel = "\x1b[2J\u2066x"\n')
    nbp.write_text(json.dumps(nb))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    assert not any(c in out + err for c in CONTROL), repr(out + err)


def test_history_error_does_not_print_control_characters_from_the_sidecar(tmp_path):  # held
    p = tmp_path / "h.csv"
    p.write_text("round,train_loss,test_acc\n1,0.5,0.9\n")
    (tmp_path / "h.json").write_text('{"method": 1, "\x1b]0;pwn\x07": [' + "1," * 3 + '"\u202e"]')  # bad JSON
    rc, out, err = cli(["history", p])
    assert not any(c in out + err for c in CONTROL), repr(out + err)


# ================================================================================ (6) secure aggregation messages
def _secagg(n=4, t=3, m=5):
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggClient, SecAggParams, SecAggServer
    params = SecAggParams(t, m, 32)
    x = np.arange(n * m, dtype=np.int64).reshape(n, m) * 3
    clients = {u: SecAggClient(u, x[u], params, np.random.default_rng(200 + u)) for u in range(n)}
    return x, clients, SecAggServer(params, range(n))


@pytest.mark.parametrize("cut", [1, -1], ids=["one byte short", "one byte long"])
def test_secagg_share_message_of_the_wrong_length_aborts_naming_the_sender(cut):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    x, clients, server = _secagg()
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    shares = {u: c.share_keys(roster) for u, c in clients.items()}
    shares[1] = shares[1][:-1] if cut == 1 else shares[1] + b"\0"
    with pytest.raises(SecAggAbort, match="client 1"):
        server.collect_shares(shares)


def test_secagg_client_given_another_clients_inbox_aborts():  # held
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    x, clients, server = _secagg()
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
    with pytest.raises(SecAggAbort, match="client 0"):
        clients[0].masked_input(inbox[1])


def test_secagg_unmasking_from_a_client_that_sent_no_masked_input_is_refused():  # held
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort
    x, clients, server = _secagg()
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
    masked = {u: c.masked_input(inbox[u]) for u, c in clients.items()}
    surv = server.collect_masked({u: masked[u] for u in (0, 1, 2)})
    msgs = {u: clients[u].unmask(surv) for u in (0, 1, 2)}
    msgs[3] = msgs[2]  # client 3 dropped at round 2, then answers round 3 with a copy
    try:
        total = server.unmask(msgs)
    except SecAggAbort as e:
        assert "3" in str(e)
    else:
        assert np.array_equal(total, x[:3].sum(0).astype(np.uint64))


# ================================================================================ (new) -p values that are not plain
@pytest.mark.parametrize("text", ["[&a [1, 2], *a, *a]", "&a {x: [*a]}", "{? [1, 2] : 3}", "[" * 3000 + "]" * 3000])
def test_p_values_with_aliases_complex_keys_or_depth_are_one_line_or_text(text):  # held
    from fedlab_nb.cli import _parse_parameters
    from fedlab_nb.repro.runner import ParameterError
    try:
        got = _parse_parameters([("x", text)])["x"]
    except ParameterError as e:
        assert "-p x" in str(e)
    else:
        json.dumps(got)  # what parameters.json holds


# ================================================================================ (new) paper_scale.py store's swap
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


def _stored_once(tmp_path, module):
    root, results = root_copy(tmp_path), tmp_path / "results"
    (results / "tiny-paper").mkdir(parents=True)
    (results / "tiny-paper" / "main.png").write_bytes(PNG + b"old")
    result = {"paper": "tiny", "scale": "paper", "verdict": "reproduced", "error": None, "metrics": {"value": 1.0},
              "figures": ["tiny-paper/main.png"], "figure_data": [],
              "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline"}]}
    (results / "tiny-paper.json").write_text(json.dumps(result))
    module.store("tiny", results, root)
    (results / "tiny-paper" / "main.png").write_bytes(PNG + b"new")
    (results / "tiny-paper.json").write_text(json.dumps({**result, "metrics": {"value": 2.0}}))
    return root, results


def test_store_keeps_figures_and_json_together_when_the_json_write_fails(tmp_path, monkeypatch):
    """The figures are swapped in before the JSON is written: a failed JSON write (disk full) leaves the new
    figures beside the old numbers, and the OSError is a traceback, not a one-line error."""
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _stored_once(tmp_path, module)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(module, "_write_temporary", full)  # the stored JSON's write (finding 42k-5 moved it)
    with pytest.raises(SystemExit):
        module.store("tiny", results, root)
    stored = json.loads((root / "papers" / "paper_scale" / "tiny.json").read_text())
    figure = (root / "papers" / "paper_scale" / "tiny" / "main.png").read_bytes()
    assert (stored["metrics"]["value"], figure) in ((1.0, PNG + b"old"), (2.0, PNG + b"new"))


def test_store_leaves_no_temporary_folder_after_a_failed_copy(tmp_path, monkeypatch):  # held
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _stored_once(tmp_path, module)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(module.shutil, "copy2", full)
    with pytest.raises(SystemExit):
        module.store("tiny", results, root)
    assert sorted(p.name for p in (root / "papers" / "paper_scale").iterdir()) == ["tiny", "tiny.json"]


def test_store_refuses_a_figure_that_is_a_link_inside_results(tmp_path):  # held
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _stored_once(tmp_path, module)
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG + b"secret")
    (results / "tiny-paper" / "main.png").unlink()
    (results / "tiny-paper" / "main.png").symlink_to(secret)
    try:
        module.store("tiny", results, root)
    except SystemExit:
        pass
    assert (root / "papers" / "paper_scale" / "tiny" / "main.png").read_bytes() != PNG + b"secret"


# ================================================================================ (new) the board's string stripping
@pytest.mark.parametrize("where", ["metric name", "claim id", "setting key", "figure name"])
def test_board_strips_control_characters_in_keys_and_names(tmp_path, where):
    from fedlab_nb.repro.report import build_report
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    evil = "\x1b]8;;http://x\x07e\u202e\u2066v"
    claim = {"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline",
             "setting": {"paper": "p", "ours": "o"}}
    result = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "metrics": {"value": 1.0}, "claims": [claim]}
    if where == "metric name":
        result["metrics"][evil] = 2.0
    elif where == "claim id":
        claim["id"] = "value_positive" + evil
    elif where == "setting key":
        claim["setting"][evil] = evil
    else:
        result["figures"] = [f"tiny-smoke/{evil}.png"]
    (results / "tiny-smoke.json").write_text(json.dumps(result))
    build_report(results, root)
    for name in ("REPORT.md", "index.html"):
        text = (results / name).read_text()
        assert not any(c in text for c in CONTROL), name


def test_list_strips_control_characters_from_a_metric_value_string(tmp_path):  # held
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    result = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "metrics": {"value": "\x1b[2J\u202ex"},
              "claims": [{"id": "value_positive", "verdict": "error", "expect": "> 0", "role": "headline",
                          "ours": "\x1b]0;t\x07", "reason": "\x9b31m"}]}
    (results / "tiny-smoke.json").write_text(json.dumps(result))
    rc, out, err = cli(["--root", root, "--results", results, "list", "--claims"])
    assert not any(c in out + err for c in CONTROL), repr(out + err)


# ================================================================================ (8) corrupt checkpoints
@pytest.mark.parametrize("value", [torch.tensor([1, 2]), 5, "0" * 16], ids=["tensor", "int", "other hash"])
def test_a_checkpoint_with_a_tampered_data_hash_is_refused(tmp_path, value):  # held
    run = dict(local_epochs=1, batch_size=8, lr=0.1, progress=False, seed=0, checkpoint=tmp_path / "c.pt", rounds=3)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate("fedavg", FederatedDataset.from_clients(pairs(0)), "logreg", callback=_stop_at(1), **run)
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    torch.save({**saved, "data": value}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="checkpoint"):
        fl.simulate("fedavg", FederatedDataset.from_clients(pairs(0)), "logreg", resume=True, **run)


# ================================================================================ (5) a real run's printed metrics
@pytest.mark.notebook
def test_run_does_not_print_control_characters_from_the_notebooks_metrics(tmp_path):
    """`fedlab-nb run` prints each recorded metric as `name = value`; a text metric must reach the terminal stripped."""
    root = root_copy(tmp_path)
    nbp = root / "notebooks" / "tiny.ipynb"
    nb = json.loads(nbp.read_text())
    nb["cells"][3]["source"] = ('repro.record("value", value)\nrepro.record("double", 2 * value)\n'
                                'repro.record("label", "\\x1b]0;pwned\\x07\\x1b[2J\\u202eok")\n')
    nbp.write_text(json.dumps(nb))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny"])
    assert rc == 0, (rc, err[-500:])
    assert "label" in out and not any(c in out + err for c in CONTROL), repr(out[-400:])


# ================================================================================ (8) corrupt result files
@pytest.mark.parametrize("text", [
    '{"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "metrics": {"value": NaN, "v2": -Infinity}, '
    '"claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline", '
    '"interval": {"mean": NaN, "half_width": Infinity, "n": 3, "confidence": 0.9}}]}',
    '{"paper": "tiny", "paper": "tiny", "scale": "smoke", "verdict": "reproduced", "claims": [], "claims": 5}',
    '\ufeff{"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "claims": []}',
    '{"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "claims": [], "metrics": {"value": 1e999}}',
], ids=["NaN and Infinity", "duplicate keys", "BOM", "1e999"])
@pytest.mark.parametrize("cmd", [["list", "--claims"], ["report"]])
def test_list_and_report_survive_odd_json_in_a_result_file(tmp_path, text, cmd):  # held
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(text, encoding="utf-8")
    rc, out, err = cli(["--root", root, "--results", results, *cmd])
    _no_traceback(rc, err)


def test_a_utf16_result_file_is_stale_not_a_crash(tmp_path):  # held
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(json.dumps({"paper": "tiny", "scale": "smoke", "verdict": "x",
                                                         "claims": []}), encoding="utf-16")
    rc, out, err = cli(["--root", root, "--results", results, "list"])
    _no_traceback(rc, err)


# ================================================================================ (7) exit status at another scale
@pytest.mark.notebook
def test_reproduce_at_paper_scale_exits_non_zero_when_one_claim_errors(tmp_path):
    root = root_copy(tmp_path, lambda t: t.replace("    metric: double\n", "    metric: no_such_metric\n"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "reproduce", "tiny", "--scale", "paper",
                        "-j", "1"])
    assert "Traceback" not in err and rc == 1, (rc, out[-600:], err[-600:])


# ================================================================================ (6) the Flower adapter's replies


@pytest.mark.parametrize("which", ["client-id True", "client-id 0.0", "client-id '0'", "no metrics record",
                                   "train-loss text", "steps 10**30", "num-examples True", "float16 delta"])
def test_flower_more_malformed_replies_are_refused_naming_the_client(fed10, which):  # held
    s = flower_strategy(fed10)
    over = {"client-id True": {"client-id": True}, "client-id 0.0": {"client-id": 0.0},
            "client-id '0'": {"client-id": "0"}, "train-loss text": {"train-loss": "\x1b[2J"},
            "steps 10**30": {"steps": 10 ** 30}, "num-examples True": {"num-examples": True}}.get(which, {})
    k = 1 if which == "client-id True" else 0
    r = flower_reply(s, k, np.zeros(s.theta.numel(), np.float16) if which == "float16 delta" else None, **over)
    if which == "no metrics record":
        del r.content["metrics"]
    with pytest.raises(ValueError, match=rf"client {k}|node {100 + k}") as e:
        s.aggregate_train(1, [r])
    assert "\x1b" not in str(e.value)


def test_flower_does_not_log_a_failed_clients_error_text_raw(fed10, caplog):
    """A reply with has_error() is logged as `node N failed this round: <its error.reason>`, the client's text
    unfiltered: escape sequences and bidi overrides from a remote client reach the server's terminal."""
    from types import SimpleNamespace
    import logging
    s = flower_strategy(fed10)
    r = flower_reply(s, 0)
    r.has_error = lambda: True
    r.error = SimpleNamespace(code=1, reason="\x1b]0;pwned\x07\x1b[2J\u202eboom")
    with caplog.at_level(logging.WARNING):
        s.aggregate_train(1, [r, flower_reply(s, 1)])
    text = " ".join(rec.getMessage() for rec in caplog.records)
    assert "failed" in text and not any(c in text for c in CONTROL), repr(text)


# ================================================================================ (3) the course folder
@pytest.mark.parametrize("where", ["student/tiny.ipynb", "instructor/tiny.ipynb", "syllabus"])
def test_make_course_does_not_write_through_links(tmp_path, monkeypatch, where):
    import fedlab_nb.repro.course as course
    monkeypatch.setattr(course, "build_syllabus", lambda root: "the syllabus\n")  # tinyroot's paper is in no lesson
    root, victim = root_copy(tmp_path), tmp_path / "victim"
    victim.write_text("precious")
    for kind in ("student", "instructor"):
        (root / "results" / "course" / kind).mkdir(parents=True)
    (root / "docs").mkdir()
    link = root / "docs" / "syllabus.md" if where == "syllabus" else root / "results" / "course" / where
    link.symlink_to(victim)
    try:
        course.write_course(root)
    except Exception as e:  # noqa: BLE001 -- a refusal naming the link is fine
        assert "link" in str(e), e
    assert victim.read_text() == "precious"


def test_make_course_refuses_a_course_folder_that_is_a_link(tmp_path, monkeypatch):  # held (make_folder)
    import fedlab_nb.repro.course as course
    monkeypatch.setattr(course, "build_syllabus", lambda root: "the syllabus\n")
    root, elsewhere = root_copy(tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "results" / "course").mkdir(parents=True)
    (root / "results" / "course" / "student").symlink_to(elsewhere)
    with pytest.raises(Exception, match="link"):
        course.write_course(root)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("scale", ['"../x"', '"a/b"', '"\\e[2Jx"', '""', '"smoke "', "1", "null", '"x\\u202e"'])
def test_scale_names_in_the_claims_file_are_refused_and_escaped(tmp_path, scale):  # held
    root = root_copy(tmp_path, lambda t: t.replace("  paper: {device: cpu, parameters: {value: 2.0}}",
                                                   "  paper: {device: cpu, parameters: {value: 2.0}}\n"
                                                   f"  {scale}: {{device: cpu, parameters: {{value: 3.0}}}}"))
    for cmd in (["list"], ["params", "tiny"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
        assert rc == 1 and "Traceback" not in err and "not a scale name" in out + err, (cmd, rc, out, err)
        assert not any(c in out + err for c in CONTROL)


# ================================================================================ (5) the board: claims file and store
@pytest.mark.parametrize("field", ["title", "authors", "method", "claim text", "paper_value", "setting"])
def test_board_strips_control_characters_that_come_from_the_claims_file(tmp_path, field):
    from fedlab_nb.repro.report import build_report
    evil = "\\e]0;pwned\\a\\e[2J\\u202e\\u2066x"
    edit = {"title": ('title: "A tiny fixture"', f'title: "{evil}"'),
            "authors": ('authors: "fedlab_nb tests"', f'authors: "{evil}"'),
            "method": ('method: "Tiny — harness fixture"', f'method: "{evil}"'),
            "claim text": ('text: "the recorded value is positive"', f'text: "{evil}"'),
            "paper_value": ('paper_value: "2x (Eq. 1)"', f'paper_value: "{evil}"'),
            "setting": ('setting: {paper: "none", ours: "n_points points"}',
                        f'setting: {{paper: "{evil}", ours: "o"}}')}
    old, new = edit[field]
    root, results = root_copy(tmp_path, lambda t: t.replace(old, new)), tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(json.dumps({
        "paper": "tiny", "scale": "smoke", "verdict": "reproduced", "metrics": {"value": 1.0},
        "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline"}]}))
    build_report(results, root)
    for name in ("REPORT.md", "index.html"):
        text = (results / name).read_text()
        assert not any(c in text for c in CONTROL), (name, field)


def test_board_strips_control_characters_from_the_stored_paper_scale_result(tmp_path):  # held
    from fedlab_nb.repro.report import build_report
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    evil = "\x1b]0;pwned\x07\x1b[2J\u202e\u2066x"
    base = {"paper": "tiny", "verdict": "reproduced", "metrics": {"value": 1.0},
            "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline",
                        "note": evil, "text": evil}]}
    (results / "tiny-smoke.json").write_text(json.dumps({**base, "scale": "smoke"}))
    (root / "papers" / "paper_scale").mkdir()
    (root / "papers" / "paper_scale" / "tiny.json").write_text(json.dumps({
        **base, "scale": "paper", "cpu": evil, "git_commit": evil, "verdict": "reproduced" + evil}))
    build_report(results, root)
    for name in ("REPORT.md", "index.html"):
        text = (results / name).read_text()
        assert not any(c in text for c in CONTROL), name


# ================================================================================ (4) requires entries
@pytest.mark.parametrize("requires", ['["os..path"]', "[1]", '["\\u00e9"]', '["' + "a" * 300 + '"]'],
                         ids=["double dot", "number", "non-ASCII", "300 characters"])
def test_requires_entries_are_checked_when_the_claims_file_is_loaded(tmp_path, requires):
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb",
                                                   f"notebook: notebooks/tiny.ipynb\nrequires: {requires}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert rc == 1 and "requires" in out + err, (rc, out[-300:], err)


# ================================================================================ (8) History sidecars and CSVs
@pytest.mark.parametrize("case", ["sidecar 100,000 deep", "sidecar 5,000-digit int", "csv 1e999", "csv 5,000-digit int",
                                  "csv NUL", "csv duplicate columns", "csv round text"])
def test_history_odd_files_are_a_summary_or_one_line(tmp_path, case):  # held
    csv = "round,train_loss,test_acc,epsilon\n1,0.5,0.9,1.0\n"
    side = json.dumps({"method": "fedavg", "dataset": "digits"})
    if case == "sidecar 100,000 deep":
        side = '{"method": ' + "[" * 100000 + "]" * 100000 + "}"
    elif case == "sidecar 5,000-digit int":
        side = '{"method": "m", "delta": ' + "9" * 5000 + "}"
    else:
        csv = {"csv 1e999": "round,train_loss,test_acc,epsilon\n1,1e999,0.9,1e999\n",
               "csv 5,000-digit int": "round,train_loss,test_acc,bytes_up\n1,0.5,0.9," + "9" * 5000 + "\n",
               "csv NUL": "round,train_loss,test_acc\n1,0.5\x00,0.9\n",
               "csv duplicate columns": "round,round,test_acc,test_acc\n1,2,0.9,0.8\n",
               "csv round text": "round,train_loss,test_acc\nabc,0.5,0.9\n"}[case]
    (tmp_path / "h.csv").write_text(csv)
    (tmp_path / "h.json").write_text(side)
    rc, out, err = cli(["history", tmp_path / "h.csv"])
    assert rc in (0, 2) and "Traceback" not in err and "raised" not in str(rc), (rc, err)
    if rc == 2:
        assert len(err.strip().splitlines()) == 1


# ========================================================================== (6) on_nonfinite under secure aggregation
def test_secure_aggregation_honours_on_nonfinite_drop():
    rng = np.random.default_rng(0)
    clients = [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(4)]
    clients[2] = (clients[2][0] * np.float32(1e30), clients[2][1])  # finite rows, a non-finite update
    fed = FederatedDataset.from_clients(clients)
    run = dict(KW, rounds=2, on_nonfinite="drop")
    assert torch.isfinite(fl.simulate("fedavg", fed, "logreg", **run).theta).all()  # the plain run drops it
    h = fl.simulate("secure_aggregation", fed, "logreg", **run)
    assert torch.isfinite(h.theta).all() and h["train_loss"].notna().all()  # the left-out client's loss is not counted


def test_secure_aggregation_with_on_nonfinite_raise_names_the_client():  # held
    rng = np.random.default_rng(0)
    clients = [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(4)]
    clients[2] = (clients[2][0] * np.float32(1e30), clients[2][1])
    with pytest.raises(ValueError, match="client 2"):
        fl.simulate("secure_aggregation", FederatedDataset.from_clients(clients), "logreg", **dict(KW, rounds=2))


def test_store_interrupted_during_the_copy_leaves_nothing_behind(tmp_path, monkeypatch):
    """Ctrl-C (or a kill signal Python sees) while store copies the figures: only OSError removes the temporary
    folder, so a hidden `.tiny.*` folder of figures stays in papers/paper_scale/ (a tracked folder) for good."""
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _stored_once(tmp_path, module)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(module.shutil, "copy2", interrupted)
    with pytest.raises(KeyboardInterrupt):
        module.store("tiny", results, root)
    assert sorted(p.name for p in (root / "papers" / "paper_scale").iterdir()) == ["tiny", "tiny.json"]
    assert (root / "papers" / "paper_scale" / "tiny" / "main.png").read_bytes() == PNG + b"old"


def test_from_clients_refuses_an_explicit_class_count_no_model_can_hold():
    x = np.zeros((10, 5), np.float32)
    with pytest.raises(ValueError, match="num_classes"):  # not simulate: building that model is the failure
        FederatedDataset.from_clients([(x, np.arange(10) % 3)] * 2, num_classes=10 ** 12)


# ====================================================================== (7) a checkpoint path that is not a file
def test_a_checkpoint_path_that_is_a_special_file_is_refused_not_replaced(tmp_path):
    import stat
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    try:
        fl.simulate("fedavg", FederatedDataset.from_clients(pairs(0)), "logreg", checkpoint=fifo, **KW)
    except (ValueError, OSError) as e:
        assert "fifo" in str(e), e
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
