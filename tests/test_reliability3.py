"""Issue 42 (reliability and security, round three): DP releases a noised θ in every round, relative results
paths, no writes through symlinks, confined paths, one run of a paper at a time, exit status, printable output,
corrupt result files."""
import copy
import math

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg, dp_fedavg_with_sampler, local_dp_fedavg
from fedlab_nb.methods.privacy.dp import dp_sampler

KW = dict(model="logreg", local_epochs=1, batch_size=8, lr=0.1, progress=False)


@pytest.fixture(scope="module")
def fed10():
    return fl.federate("digits", "iid", n_clients=10, seed=0)


def theta0(fed):
    from fedlab_nb.engine.server import build_model
    from fedlab_nb.models import flatten_params
    return flatten_params(build_model("logreg", fed, 0)).to(fed.device)


def thetas(method, fed, sampler, rounds):
    seen = [theta0(fed)]
    h = fl.simulate(method, fed, rounds=rounds, clients_per_round=sampler, seed=0,
                    callback=lambda r, theta, row: seen.append(theta.clone()), **KW)
    return h, seen


# (1) DP: a round nobody is sampled in still releases a noised θ and counts ---------------------------------
@pytest.mark.parametrize("adaptive", [False, True])
def test_dp_fedavg_releases_noise_in_rounds_without_clients(fed10, adaptive):
    kw = dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1, adaptive=adaptive)
    if adaptive:
        kw["clip_count_stddev"] = 1.0
    method, sampler = dp_fedavg_with_sampler(fed10, **kw)
    h, seen = thetas(method, fed10, sampler, 12)
    assert (h["n_sampled"] == 0).sum() >= 3  # q·K = 1: about a third of the rounds are empty
    assert len(seen) == 13
    for r in range(1, 13):
        assert not torch.equal(seen[r], seen[r - 1]), f"round {r} released θ without noise"
    assert np.isfinite(h["epsilon"]).all() and h["epsilon"].is_monotonic_increasing
    assert h["epsilon"].iloc[-1] == pytest.approx(method.rule.epsilon_after(12))


def test_dp_fedavg_round_with_every_update_dropped_is_noised(fed10):
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=1.0)
    nan = lambda updates, byz, generator=None: updates + float("nan")
    with pytest.warns(UserWarning, match="every round"):
        h = fl.simulate(method, fed10, rounds=2, seed=0, attack=nan, byzantine=range(10), on_nonfinite="drop", **KW)
    assert not torch.equal(h.theta, theta0(fed10)) and h["train_loss"].isna().all()
    assert np.isfinite(h["epsilon"]).all()


def test_local_dp_reports_epsilon_in_empty_rounds(fed10):
    h = fl.simulate(local_dp_fedavg(1.0, 0.5), fed10, rounds=8, clients_per_round=dp_sampler(0.1, 10), seed=0, **KW)
    assert (h["n_sampled"] == 0).any() and np.isfinite(h["epsilon"]).all()


def test_non_dp_empty_rounds_are_unchanged(fed10):
    h, seen = thetas(fl.get_method("fedavg"), fed10, dp_sampler(0.1, 10), 8)
    empty = np.flatnonzero(h["n_sampled"].to_numpy() == 0)
    assert len(empty) and all(torch.equal(seen[r + 1], seen[r]) for r in empty)
    assert h["train_loss"].iloc[empty].isna().all()


# (2) a relative --results (or $FEDLAB_NB_RESULTS) is the caller's, resolved once ------------------------------
def cli_root(tmp_path):
    import shutil
    from pathlib import Path
    root = tmp_path / "root"
    shutil.copytree(Path(__file__).parent / "data" / "tinyroot", root)
    return root


@pytest.mark.notebook
def test_reproduce_with_a_relative_results_folder(tmp_path, monkeypatch, capsys):
    import json
    from fedlab_nb.cli import main
    root = cli_root(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["--root", "root", "--results", "res", "reproduce", "tiny"]) == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "res" / "tiny-smoke.json").read_text())
    assert result["verdict"] == "partially reproduced" and (tmp_path / "res" / "tiny-smoke.kernel.log").is_file()
    assert not (root / "notebooks" / "res").exists()
    monkeypatch.setenv("FEDLAB_NB_RESULTS", "env_res")
    assert main(["--root", str(root), "lab", "--dry-run"]) == 0
    assert f"--ServerApp.root_dir={tmp_path / 'env_res' / 'lab'}" in capsys.readouterr().out


# (3) never through a link; paths from files confined; scale names and requires validated ---------------------
def cli_args(tmp_path, root):
    return ["--root", str(root), "--results", str(tmp_path / "results")]


def test_reproduce_refuses_a_link_in_the_results_folder(tmp_path, capsys):
    from fedlab_nb.cli import main
    root, victim = cli_root(tmp_path), tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.png").write_bytes(b"precious")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "tiny-smoke").symlink_to(victim)
    assert main(cli_args(tmp_path, root) + ["reproduce", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "tiny-smoke is a symbolic link" in err and "Traceback" not in err
    assert (victim / "keep.png").read_bytes() == b"precious" and [p.name for p in victim.iterdir()] == ["keep.png"]
    (tmp_path / "results" / "tiny-smoke").unlink()
    (tmp_path / "results" / "tiny-smoke.json").symlink_to(victim / "keep.png")
    assert main(cli_args(tmp_path, root) + ["run", "tiny"]) in (0, 1)  # run has its own folder: not affected
    capsys.readouterr()
    assert main(cli_args(tmp_path, root) + ["reproduce", "tiny", "--force"]) == 1
    assert "tiny-smoke.json is a symbolic link" in capsys.readouterr().err
    assert (victim / "keep.png").read_bytes() == b"precious"


def test_lab_refuses_a_link_to_a_notebook_copy(tmp_path, capsys):
    from fedlab_nb.cli import main
    root, victim = cli_root(tmp_path), tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "results" / "lab").mkdir(parents=True)
    (tmp_path / "results" / "lab" / "tiny.ipynb").symlink_to(victim)
    assert main(cli_args(tmp_path, root) + ["lab", "--dry-run", "--fresh"]) == 1
    assert "tiny.ipynb is a symbolic link" in capsys.readouterr().err and victim.read_text() == "precious"


def edited_root(tmp_path, edit):
    import yaml
    root = cli_root(tmp_path)
    path = root / "papers" / "tiny.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return root


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["scales"].update({"../../../x": copy.deepcopy(d["scales"]["smoke"])}), "is not a scale name"),
    (lambda d: d.update(notebook="/etc/passwd"), "relative to the repository root"),
    (lambda d: d.update(notebook="../outside.ipynb"), "relative to the repository root"),
])
def test_claims_file_paths_and_scale_names_are_confined(tmp_path, edit, match):
    from fedlab_nb.repro import claims as C
    root = edited_root(tmp_path, edit)
    with pytest.raises(C.ClaimsFileError, match=match):
        C.load_paper("tiny", root)


def test_notebook_link_out_of_the_repository_and_path_like_scale_are_refused(tmp_path):
    from fedlab_nb.repro import claims as C
    from fedlab_nb.repro.files import UnsafePathError
    from fedlab_nb.repro.runner import ParameterError, check_scale, notebook_path
    root = cli_root(tmp_path)
    outside = tmp_path / "outside.ipynb"
    (root / "notebooks" / "tiny.ipynb").rename(outside)
    (root / "notebooks" / "tiny.ipynb").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="outside the repository"):
        notebook_path(C.load_paper("tiny", root))
    for bad in ("../x", "a/b", "", "x" * 65, 3):
        with pytest.raises(ParameterError, match="not a scale name"):
            check_scale(bad)


def test_result_outputs_are_confined_to_the_results_folder(tmp_path):
    from fedlab_nb.repro.results import safe_output
    from fedlab_nb.repro.runner import _outputs_intact
    (tmp_path / "ok.txt").write_text("x")
    (tmp_path / "link").symlink_to("/dev/zero")
    for bad in ("/dev/zero", "../ok.txt", "link", "", None, "missing"):
        assert safe_output(tmp_path, bad) is None
    assert safe_output(tmp_path, "ok.txt") == (tmp_path / "ok.txt").resolve()
    assert not _outputs_intact({"outputs": {"/dev/zero": "0" * 64}}, tmp_path)  # returns at once, reads nothing


def test_requires_entries_are_module_names_and_nothing_is_imported(tmp_path):
    import sys
    from fedlab_nb.repro import claims as C
    paper = C.load_paper("tiny", edited_root(tmp_path, lambda d: d.update(requires=["this.x", "json.nope"])))
    sys.modules.pop("this", None)
    assert C.missing_requirements(paper) == [] and "this" not in sys.modules  # 'this' prints the Zen on import
    for bad in ("..x", 1, None, "", "a b", "x."):  # refused when the file is loaded, by every command alike
        with pytest.raises(C.ClaimsFileError, match="requires"):
            C.load_paper("tiny", edited_root(tmp_path / str(id(bad)), lambda d: d.update(requires=[bad])))


# (4) one run of a paper at a time; a killed run leaves the old result intact ---------------------------------
def old_result(results):
    (results / "tiny-smoke").mkdir(parents=True)
    (results / "tiny-smoke" / "main.png").write_bytes(b"old figure")
    (results / "tiny-smoke.json").write_text('{"old": true}')


def test_a_second_run_of_the_same_paper_is_refused_naming_the_first(tmp_path, capsys):
    from fedlab_nb.cli import main
    from fedlab_nb.repro.files import run_lock
    root, results = cli_root(tmp_path), tmp_path / "results"
    old_result(results)
    with run_lock(results, "tiny", "paper"):
        assert main(cli_args(tmp_path, root) + ["reproduce", "tiny"]) == 1
        err = capsys.readouterr().err
        assert "another run of tiny" in err and "scale paper" in err and "process" in err
        assert main(cli_args(tmp_path, root) + ["run", "tiny"]) == 1
        assert "another run of tiny" in capsys.readouterr().err
    assert (results / "tiny-smoke" / "main.png").read_bytes() == b"old figure"
    assert not (results / "tiny.lock").exists()  # released (and removed) on the way out


def test_a_killed_run_leaves_the_old_result_and_its_figures(tmp_path, monkeypatch):
    import papermill
    from fedlab_nb.repro.runner import reproduce
    root, results = cli_root(tmp_path), tmp_path / "results"
    old_result(results)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if the run were stopped while the kernel runs
    monkeypatch.setattr(papermill, "execute_notebook", killed)
    with pytest.raises(KeyboardInterrupt):
        reproduce("tiny", "smoke", force=True, out_dir=results, root=root)
    assert (results / "tiny-smoke" / "main.png").read_bytes() == b"old figure"
    assert (results / "tiny-smoke.json").read_text() == '{"old": true}'
    assert sorted(p.name for p in results.iterdir()) == ["tiny-smoke", "tiny-smoke.json"]


# (5) exit status when a claim errors at any scale; -p values are YAML 1.2 -------------------------------------
@pytest.mark.notebook
def test_reproduce_fails_when_a_claim_errors_at_a_non_smoke_scale(tmp_path, capsys):
    from fedlab_nb.cli import main

    def add_unjudgeable(d):
        d["claims"].append({"id": "unrecorded", "role": "supporting", "text": "a metric nobody records",
                            "metric": "nowhere", "expect": "> 0", "verdict": "reproduced"})
    root = edited_root(tmp_path, add_unjudgeable)
    assert main(cli_args(tmp_path, root) + ["reproduce", "tiny", "--scale", "paper"]) == 1
    captured = capsys.readouterr()
    assert "unrecorded: error" in captured.out and "could not be judged: unrecorded" in captured.err


def test_parameter_values_follow_yaml_1_2():
    from fedlab_nb.cli import _parse_parameters
    got = _parse_parameters([["lr", "1e-3"], ["day", "2024-01-01"], ["n", "010"], ["flag", "yes"], ["ok", "true"],
                             ["xs", "[1, 2.5, 1E3]"], ["big", "-2.5e+2"], ["none", "null"], ["t", "1:20"]])
    assert got == {"lr": 0.001, "day": "2024-01-01", "n": 10, "flag": "yes", "ok": True, "xs": [1, 2.5, 1000.0],
                   "big": -250.0, "none": None, "t": "1:20"}
    assert isinstance(got["lr"], float) and isinstance(got["day"], str)


# (6) control characters from files are not printed; (7) corrupt result files do not break list / report ---------
def test_printable_strips_terminal_control_characters():
    from fedlab_nb.repro.results import printable
    assert printable("ok\x1b]0;title\x07\x1b[2J\rdone\u202e\x9b\nnext") == "ok]0;title[2Jdone next"
    assert printable("x" * 5000, 80) == "x" * 79 + "…"


def valid_result(paper):
    return {"paper": paper, "scale": "smoke", "verdict": "reproduced",
            "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "interval": None,
                        "reason": "\x1b[2Jcleared"}]}


@pytest.mark.parametrize("corrupt", [
    '{"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "claims": [{"id": "value_positive", '
    '"verdict": "reproduced", "expect": "> 0", "interval": "0.5 ± 0.1"}]}',
    "[" * 100_000 + "]" * 100_000,
    '{"paper": "tiny", "scale": "smoke", "verdict": "x", "claims": [], "ours": ' + "9" * 5000 + "}",
    '{"paper": "tiny", "scale": "smoke", "verdict": "x", "claims": [{"id": "a", "verdict": "b", "expect": "c", '
    '"interval": {"mean": ' + "9" * 400 + ', "half_width": 1, "n": 5, "confidence": 0.9}}]}',
])
def test_corrupt_result_files_do_not_break_list_or_report(tmp_path, capsys, corrupt):
    import json
    import shutil
    from fedlab_nb.cli import main
    root, results = cli_root(tmp_path), tmp_path / "results"
    shutil.copy(root / "papers" / "tiny.yaml", root / "papers" / "tiny2.yaml")
    text = (root / "papers" / "tiny2.yaml").read_text().replace("id: tiny", "id: tiny2")
    (root / "papers" / "tiny2.yaml").write_text(text)
    results.mkdir()
    (results / "tiny-smoke.json").write_text(corrupt)
    (results / "tiny2-smoke.json").write_text(json.dumps(valid_result("tiny2")))
    assert main(cli_args(tmp_path, root) + ["list"]) == 0
    captured = capsys.readouterr()
    assert "tiny2 — Tiny — harness fixture: partially reproduced (supporting 0/1 reproduced; checks 1/1 hold; " \
           "last: smoke: reproduced)" in captured.out
    assert "tiny — Tiny — harness fixture: partially reproduced (supporting 0/1 reproduced; checks 1/1 hold; " \
           "last: smoke: stale (corrupt result file))" in captured.out
    [warning] = [line for line in captured.err.splitlines() if "tiny-smoke.json" in line]
    assert warning.startswith("warning: ") and len(warning) < 400
    assert main(cli_args(tmp_path, root) + ["report"]) == 0
    assert "2 papers, by headline verdict: " in capsys.readouterr().out
    assert "tiny2" in (results / "REPORT.md").read_text()


def test_reproduce_output_from_a_result_file_is_printable(tmp_path, capsys, monkeypatch):
    from fedlab_nb import cli
    monkeypatch.setattr(cli, "_reproduce_paper", lambda pid, opts: (pid, 0, ["tiny (smoke): \x1b[2J\x1b]0;x\x07OK"],
                                                                   ["\x1b[31mwarning"]))
    root = cli_root(tmp_path)
    assert cli.main(cli_args(tmp_path, root) + ["reproduce", "tiny", "-j", "1"]) == 0
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "\x07" not in captured.out


# (8) privacy parameters, samplers, lab ------------------------------------------------------------------------
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("build, match", [
    (lambda: dp_fedavg(noise_multiplier=INF), "noise_multiplier"),
    (lambda: dp_fedavg(noise_multiplier=NAN), "noise_multiplier"),
    (lambda: dp_fedavg(noise_multiplier=-1.0), "noise_multiplier"),
    (lambda: dp_fedavg(clip_norm=INF), "clip_norm"),
    (lambda: dp_fedavg(clip_lr=INF, adaptive=True, clip_count_stddev=1.0), "clip_lr"),
    (lambda: dp_fedavg(clip_lr=-0.2), "clip_lr"),
    (lambda: dp_fedavg(delta="1e-5"), "delta"),
    (lambda: local_dp_fedavg(noise_multiplier=INF), "noise_multiplier"),
    (lambda: local_dp_fedavg(clip_norm=NAN), "clip_norm"),
])
def test_privacy_parameters_are_finite_and_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_local_dp_accounting_and_accountant_validate_their_arguments():
    from fedlab_nb.methods.privacy import accounting
    from fedlab_nb.methods.privacy.dp import LocalDPAccounting
    for bad in (INF, NAN, -1.0, "1"):
        with pytest.raises(ValueError, match="noise_multiplier"):
            LocalDPAccounting(bad)
    with pytest.raises(TypeError, match="delta must be a number, got str '1e-5'"):
        accounting.epsilon(0.1, 1.0, 10, delta="1e-5")
    with pytest.raises(ValueError, match="steps must be an int"):
        accounting.epsilon(0.1, 1.0, True, 1e-5)
    with pytest.raises(ValueError, match="target_epsilon must be a finite number"):
        accounting.noise_for_epsilon(INF, 0.1, 10, 1e-5)


@pytest.mark.parametrize("ids, match", [([0, 0, 3], r"client id\(s\) \[0\] more than once"),
                                        ([1, 10], r"client id\(s\) \[10\] outside 0 … 9"),
                                        ([-1], "outside"), ([0.5], "client ids \\(ints\\)")])
def test_a_custom_sampler_with_bad_ids_is_refused(fed10, ids, match):
    with pytest.raises(ValueError, match=match):
        fl.simulate("fedavg", fed10, rounds=1, clients_per_round=lambda r, K, g: np.array(ids), **KW)


def test_lab_passes_options_and_allow_root_when_root(tmp_path, capsys, monkeypatch):
    import os
    from fedlab_nb.cli import main
    root = cli_root(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert main(cli_args(tmp_path, root) + ["lab", "--dry-run", "--port", "9999", "--ip", "0.0.0.0", "--no-browser"]) == 0
    out = capsys.readouterr().out
    assert "passing --allow-root" in out and "--port=9999 --ip=0.0.0.0 --no-browser --allow-root" in out
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(cli_args(tmp_path, root) + ["lab", "--dry-run"]) == 0
    assert "--allow-root" not in capsys.readouterr().out


# (9) secure aggregation: every message from a client is checked, a bad one aborts naming the sender ---------
def secagg_party(n=3, m=4, users=None):
    from fedlab_nb.methods.privacy import secure_aggregation as S
    params = S.SecAggParams(2, m, 16)
    clients = {u: S.SecAggClient(u, np.arange(m, dtype=np.uint64) + u, params, np.random.default_rng(u))
               for u in range(n)}
    return S, clients, S.SecAggServer(params, range(n) if users is None else users)


def secagg_to_masked(S, clients, server):
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
    return {u: c.masked_input(inbox[u]) for u, c in clients.items()}


@pytest.mark.parametrize("edit, match", [
    (lambda y: {**y, 1: y[1][:2]}, r"client 1 has 2 bytes, expected 40"),       # was broadcast: a wrong sum
    (lambda y: {**y, 1: y[1] + y[1]}, r"client 1 has 80 bytes, expected 40"),   # 8 bytes of y, then its 32-byte MAC
    (lambda y: {**y, 1: np.frombuffer(y[1], np.uint16)}, r"client 1 is a ndarray, not bytes"),
    (lambda y: {**y, 7: y[1]}, r"client 7 comes from a user that is not in this round"),
    (lambda y: {**y, "1": y.pop(1)}, r"client '1' comes from a user"),
])
def test_secagg_server_refuses_a_malformed_masked_input(edit, match):
    S, clients, server = secagg_party()
    y = secagg_to_masked(S, clients, server)
    with pytest.raises(S.SecAggAbort, match=match):
        server.collect_masked(edit(dict(y)))


def test_secagg_refuses_bad_public_keys_and_unsampled_senders():
    S, clients, server = secagg_party(users=[0, 1])
    keys = {u: c.advertise_keys() for u, c in clients.items()}
    with pytest.raises(S.SecAggAbort, match=r"client 2 comes from a user that is not in this round.*\[0, 1\]"):
        server.collect_keys(keys)
    with pytest.raises(S.SecAggAbort, match=r"client 1 has 63 bytes, expected 64"):
        server.collect_keys({0: keys[0], 1: keys[1][1:]})
    roster = b"".join(u.to_bytes(4, "little") + keys[u] for u in (0, 1))
    with pytest.raises(S.SecAggAbort, match=r"client 0: the message from the server \(the roster\) has 135 bytes"):
        clients[0].share_keys(roster[:-1])                                    # a 31-byte key sent to an honest client
    zero = roster[:4 + 64] + (1).to_bytes(4, "little") + bytes(32) + keys[1][32:]  # a low-order X25519 point
    with pytest.raises(S.SecAggAbort, match=r"client 0: the message from user 1 carries a public key X25519 refuses"):
        clients[0].share_keys(zero)


def test_secagg_server_refuses_misaddressed_shares_and_unmasking_records():
    S, clients, server = secagg_party()
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    shares = {u: c.share_keys(roster) for u, c in clients.items()}
    with pytest.raises(S.SecAggAbort, match=r"client 2 addresses shares to \[0\], not once to each other user"):
        server.collect_shares({**shares, 2: shares[2][:S.COMMIT_BYTES + (len(shares[2]) - S.COMMIT_BYTES) // 2]})
    inbox = server.collect_shares(shares)
    server.collect_masked({u: c.masked_input(inbox[u]) for u, c in clients.items()})
    survivors = b"".join(u.to_bytes(4, "little") for u in range(3))
    replies = {u: c.unmask(survivors) for u, c in clients.items()}
    s_share = (0).to_bytes(4, "little") + bytes([1]) + bytes(32)              # asks for a survivor's s^SK
    for bad, match in [(replies[1][:-3], "client 1 ends in a torn record"),
                       (replies[1] + s_share, "client 1 holds a share of kind 1 for user 0"),
                       (replies[1][:21], r"client 1 holds shares for \[1\], not once for each user")]:
        with pytest.raises(S.SecAggAbort, match=match):
            server.unmask({**replies, 1: bad})
    np.testing.assert_array_equal(server.unmask(replies), (np.arange(4) * 3 + 3) & 0xFFFF)


def test_secagg_client_input_is_checked():
    S, _, _ = secagg_party()
    params = S.SecAggParams(2, 4, 16)
    for x, match in [(np.zeros(3, np.uint64), "length m=4"), (np.zeros(4), "integer vector"),
                     (np.full(4, 2 ** 16, np.uint64), r"\[0, 2\^16\)")]:
        with pytest.raises(ValueError, match=match):
            S.SecAggClient(0, x, params)


# (10) Flower: every reply is checked against the node that sent it and the round's sample ---------------------
def flower_strategy(fed, on_nonfinite="raise"):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import MethodStrategy, _setup
    s = MethodStrategy(_setup("fedavg", fed, "logreg", rounds=1, clients_per_round=3, on_nonfinite=on_nonfinite))
    s.nodes, s.sampled, s._t0 = {k: 100 + k for k in range(fed.num_clients)}, np.array([0, 1, 2]), 0.0
    s.down, s.theta_bytes = {"theta": s.theta}, 0
    return s


def flower_reply(s, k, node=None, delta=None, **metrics):
    from types import SimpleNamespace
    from flwr.app import Array
    delta = np.full(s.theta.numel(), 0.01, np.float32) if delta is None else delta
    honest = s._steps_run(0, k) if 0 <= k < s.s.num_clients else 1  # the steps client k runs in round 1
    metrics = {"client-id": k, "num-examples": 10, "steps": honest, "train-loss": 0.5, "bytes-up": 400, **metrics}
    entries = delta if isinstance(delta, dict) else {"delta": delta}
    return SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(src_node_id=100 + k if node is None else node),
                           content={"metrics": metrics, "message": {n: Array(a) for n, a in entries.items()}})


def flower_bad(s, which):
    d = s.theta.numel()
    return {"other": flower_reply(s, 1, node=100), "unsampled": flower_reply(s, 3, node=103),
            "float id": flower_reply(s, 0, **{"client-id": 0.0}), "short": flower_reply(s, 1, delta=np.zeros(d - 1, np.float32)),
            "float64": flower_reply(s, 1, delta=np.zeros(d, np.float64)),
            "extra": flower_reply(s, 1, delta={"delta": np.zeros(d, np.float32), "x": np.zeros(1, np.float32)}),
            "metric": flower_reply(s, 1, **{"num-examples": "10"})}[which]


@pytest.mark.parametrize("which, match", [
    ("other", r"node 100 \(client 0\) claims client id 1"), ("unsampled", r"node 103 \(client 3\) comes from a client not sampled this round \(sampled: \[0, 1, 2\]\)"),
    ("float id", r"claims client id 0.0"), ("short", r"client 1 has entries"), ("extra", r"client 1 has entries"),
    ("float64", r"client 0 has entries .*float32"), ("metric", r"client 1 has metrics")])
def test_flower_refuses_a_reply_for_another_client_or_of_the_wrong_form(fed10, which, match):
    s = flower_strategy(fed10)
    bad = flower_bad(s, which)
    replies = [flower_reply(s, k) for k in (0, 1, 2) if k != bad.content["metrics"]["client-id"]] + [bad]
    if which == "float64":
        replies = [flower_reply(s, k, delta=np.zeros(s.theta.numel(), np.float64)) for k in (0, 1, 2)]
    with pytest.raises(ValueError, match=match):
        s.aggregate_train(1, replies)


def test_flower_honours_on_nonfinite(fed10):
    from fedlab_nb.engine.server import NonFiniteUpdateError
    nan = np.full(flower_strategy(fed10).theta.numel(), np.nan, np.float32)
    with pytest.raises(NonFiniteUpdateError):
        s = flower_strategy(fed10)
        s.aggregate_train(1, [flower_reply(s, 0, delta=nan), flower_reply(s, 1)])
    s = flower_strategy(fed10, "drop")
    before = s.theta.clone()
    s.aggregate_train(1, [flower_reply(s, 0, delta=nan), flower_reply(s, 1)])
    assert torch.allclose((s.theta - before).abs(), torch.tensor(0.01)) and s.rows[-1]["train_loss"] == pytest.approx(0.5)
    from fedlab_nb.flower import to_flower
    to_flower("fedavg", fed10, "logreg", on_nonfinite="drop")
    with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'drop'"):
        to_flower("fedavg", fed10, "logreg", on_nonfinite="skip")


@pytest.mark.parametrize("pid", ["abc", 1.9, 1.0, True, -1, 10, None])
def test_flower_partition_id_must_be_an_integer_client_id(pid):
    pytest.importorskip("flwr")
    from types import SimpleNamespace
    from fedlab_nb.flower import _client_id
    with pytest.raises(ValueError, match=r"partition-id=.*must be an integer client id in 0..9"):
        _client_id(SimpleNamespace(node_config={"partition-id": pid}), 10)
    assert _client_id(SimpleNamespace(node_config={"partition-id": "3"}), 10) == 3


# (11) on_nonfinite="drop" that drops every update warns naming the rounds ------------------------------------
def test_dropping_every_update_warns_naming_the_rounds(fed10):
    nan = lambda updates, byz, generator=None: updates + float("nan")
    with pytest.warns(UserWarning, match=r"dropped every client's update \(NaN/inf\) in every round: round\(s\) \[1, 2\]"):
        h = fl.simulate("fedavg", fed10, rounds=2, seed=0, attack=nan, byzantine=range(10), on_nonfinite="drop", **KW)
    assert h["train_loss"].isna().all()
    half = lambda updates, byz, generator=None: updates + float("nan") * byz[:, None].to(updates)
    with pytest.warns(UserWarning, match=r"in 1 of 2 rounds: round\(s\) \[2\]"):
        fl.simulate("fedavg", fed10, rounds=2, seed=0, clients_per_round=lambda r, K, g: np.array([0, 1]) + 2 * r,
                    attack=half, byzantine=[2, 3], on_nonfinite="drop", **KW)


# (12) CLI: one-line errors for a bad History sidecar, a long paper id, a results path that is a file or read-only
@pytest.mark.parametrize("sidecar, match", [("{bad", r"h\.json is not valid UTF-8 JSON"), ("[1, 2]", r"h\.json holds a JSON list"),
                                            (b"\xff\xfe", r"h\.json is not valid UTF-8"), ("[" * 100_000, "not valid")])
def test_history_with_a_malformed_sidecar_is_one_line_naming_it(tmp_path, capsys, sidecar, match):
    from fedlab_nb.cli import main
    (tmp_path / "h.csv").write_text("round,train_loss\n1,0.5\n")
    (tmp_path / "h.json").write_bytes(sidecar if isinstance(sidecar, bytes) else sidecar.encode())
    assert main(["history", str(tmp_path / "h.csv")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and len(err) < 400 and "delete it" in err
    assert __import__("re").search(match, err)


def test_a_very_long_paper_id_gives_a_short_error(tmp_path, capsys):
    from fedlab_nb.cli import main
    root = cli_root(tmp_path)
    for cmd in (["run"], ["reproduce"], ["figures", "check"]):
        assert main(cli_args(tmp_path, root) + cmd + ["a" * 5000]) == 2
        err = capsys.readouterr().err
        assert "too long (at most 64 characters)" in err and len(err) < 300


def test_results_path_that_is_a_file_or_read_only_names_it_and_the_fix(tmp_path, capsys, monkeypatch):
    import os
    from fedlab_nb.cli import main
    root, file = cli_root(tmp_path), tmp_path / "file"
    file.write_text("x")
    for cmd in (["list"], ["report"], ["run", "tiny"], ["reproduce", "tiny"], ["lab", "--dry-run"]):
        assert main(["--root", str(root), "--results", str(file)] + cmd) == 2
        err = capsys.readouterr().err
        assert f"the results folder {file} is a file, not a folder: give --results" in err and len(err.splitlines()) == 1
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: make the folder refuse writes as a read-only mount does
        import tempfile
        monkeypatch.setattr(tempfile, "TemporaryFile", lambda **kw: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    for cmd in (["report"], ["run", "tiny"], ["reproduce", "tiny"]):
        assert main(["--root", str(root), "--results", str(ro)] + cmd) == 1
        err = capsys.readouterr().err
        assert f"cannot write into the results folder {ro} (Permission denied): make it writable (chmod u+w {ro})" in err
        assert len(err.splitlines()) == 1
    assert not list(ro.iterdir())


# (13) a full disk: one line naming the folder and the fix; results already written are kept ----------------
def _disk_full(*args, **kwargs):
    import errno
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_during_report_is_one_line_and_keeps_the_results(tmp_path, capsys, monkeypatch):
    import pathlib
    from fedlab_nb.cli import main
    root, results = cli_root(tmp_path), tmp_path / "results"
    results.mkdir()
    kept = results / "tiny-smoke.json"
    kept.write_text('{"paper": "tiny"}')
    monkeypatch.setattr(pathlib.Path, "write_text", _disk_full)
    assert main(["--root", str(root), "--results", str(results), "report"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedlab-nb report: error: the disk is full (No space left on device) while writing")
    assert "free space there, or give --results a folder on another disk" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert kept.read_text() == '{"paper": "tiny"}'


def test_other_os_errors_are_not_taken_for_a_full_disk(tmp_path, monkeypatch, capsys):
    import errno
    import pathlib
    from fedlab_nb.cli import main
    root, results = cli_root(tmp_path), tmp_path / "results"
    results.mkdir()

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(pathlib.Path, "write_text", broken)
    assert main(["--root", str(root), "--results", str(results), "report"]) == 1  # one line of its own (probe 42l)
    err = capsys.readouterr().err
    assert "I/O error" in err and "disk is full" not in err and len(err.splitlines()) == 1


@pytest.mark.notebook
def test_full_disk_while_a_run_publishes_keeps_the_previous_result(tmp_path, capsys, monkeypatch):
    from fedlab_nb.cli import main
    from fedlab_nb.repro import runner
    root = cli_root(tmp_path)
    assert main(cli_args(tmp_path, root) + ["reproduce", "tiny"]) == 0, capsys.readouterr().err
    result = tmp_path / "results" / "tiny-smoke.json"
    before = result.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(runner, "write_json_atomic", _disk_full)
    assert main(cli_args(tmp_path, root) + ["reproduce", "tiny", "--force"]) == 1
    err = capsys.readouterr().err
    assert "error: the disk is full" in err and "results already written are kept" in err
    assert "Traceback" not in err and len([l for l in err.splitlines() if "error:" in l]) == 1
    assert result.read_bytes() == before
    assert not list((tmp_path / "results").glob(".tiny-smoke.*.running"))


# (14) the other privacy modules refuse a non-finite noise multiplier or clip, naming it ---------------------
@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, True, "1"])
def test_noise_multiplier_checks_in_fedsvd_cpa_and_gradient_inversion(bad):
    from fedlab_nb.methods.privacy.cpa import dp_fc_gradient
    from fedlab_nb.methods.privacy.fedsvd import lora_dp_method
    from fedlab_nb.methods.privacy.gradient_inversion import clip_and_noise
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        clip_and_noise({"w": torch.ones(3)}, 1.0, bad, g)
    with pytest.raises(ValueError, match="clip must be a finite number"):
        clip_and_noise({"w": torch.ones(3)}, math.inf, 1.0, g)
    with pytest.raises(ValueError, match="noise_multiplier"):
        lora_dp_method(None, noise_multiplier=bad, clip_norm=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_fc_gradient(torch.nn.Linear(2, 2), torch.ones(4, 2), torch.zeros(4, dtype=torch.long), 1.0, bad)
