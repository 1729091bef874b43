"""Issue 42 (reliability and security, round three): DP releases a noised θ in every round, relative results
paths, no writes through symlinks, confined paths, one run of a paper at a time, exit status, printable output,
corrupt result files."""
import math

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.dp_fedavg import dp_fedavg, dp_fedavg_with_sampler, local_dp_fedavg
from fedlab_nb.privacy.dp import dp_sampler

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
