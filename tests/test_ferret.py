"""Ferret (fedlab_nb.methods.communication.ferret): shared-seed directions, exact server reconstruction, measured bytes."""
import importlib
import subprocess
import sys

import pytest
import torch

import fedlab_nb as fl

F = importlib.import_module("fedlab_nb.methods.communication.ferret")   # the package attribute `ferret` is the factory


def test_directions_are_deterministic_and_keyed():
    a = F.directions(F.round_seed(3, 5), (40, 7), (6, 2))
    b = F.directions(F.round_seed(3, 5), (40, 7), (6, 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    other = F.directions(F.round_seed(3, 6), (40, 7), (6, 2))
    assert not torch.equal(a[0], other[0])  # a new round gives new directions


def test_directions_same_in_another_process():
    code = ("import importlib, torch; F = importlib.import_module('fedlab_nb.methods.communication.ferret'); "
            "V = F.directions(F.round_seed(11, 2), (30, 5), (4, 2)); print(repr(float(sum(v.double().sum() for v in V))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    here = float(sum(v.double().sum() for v in F.directions(F.round_seed(11, 2), (30, 5), (4, 2))))
    assert float(out) == here


def test_server_reconstruction_equals_client_reconstruction_bitwise():
    spec = F.FerretSpec(K=12, blocks=(50, 10), key=7)
    D = torch.randn(4, 60, dtype=torch.float64)
    client_V = spec.directions(3, 60, torch.float64, "cpu")
    coefs = F.project(D, client_V)
    client_own = F.reconstruct(coefs, client_V)                       # what the client's update becomes
    server_V = spec.directions(3, 60, torch.float64, "cpu")           # regenerated from the seed only
    assert torch.equal(F.reconstruct(coefs, server_V), client_own)
    # the server averages coefficients then reconstructs once: equals the mean of the clients' Δ̂ (linear)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    rule = F.FerretReconstruct(spec)
    info = fl.methods.RoundInfo(3, None, w, w, 4, 0.1, torch.zeros(60, dtype=torch.float64))
    agg, _ = rule.aggregate({}, coefs, w, info=info)
    assert (agg - (w / w.sum()) @ client_own).abs().max() <= 1e-12


def test_lstsq_recovers_update_when_directions_span():
    D = torch.randn(3, 30, dtype=torch.float64)
    V = F.directions(1, (20, 10), (24, 10), torch.float64)   # K_b >= d_b in every block
    assert (F.reconstruct(F.project(D, V, "lstsq"), V) - D).abs().max() <= 1e-10
    V = F.directions(1, (30,), (10,), torch.float64)         # K < d: the orthogonal projection, shorter than Δ
    R = F.reconstruct(F.project(D, V, "lstsq"), V)
    assert torch.allclose(F.reconstruct(F.project(R, V, "lstsq"), V), R, atol=1e-10)  # idempotent
    assert (R.norm(dim=1) < D.norm(dim=1)).all()


def test_unbiased_estimator_mean_converges():
    D = torch.randn(1, 20, dtype=torch.float64)
    est = torch.stack([F.reconstruct(F.project(D, V := F.directions(s, (20,), (5,), torch.float64)), V)[0]
                       for s in range(2000)]).mean(0)
    assert (est - D[0]).norm() / D.norm() < 0.15   # relative sd of the mean ≈ sqrt((d+1)/K / 2000) ≈ 0.05


def test_allocation_and_blocks():
    assert F.allocate(10, (90, 10)) == (8, 2)   # one per block, the other 8 split 7.2 / 0.8 (largest remainder)
    assert sum(F.allocate(37, (2048, 32, 320, 10))) == 37
    model = fl.models.make_model("mlp", (64,), 10, hidden=(32,))
    assert F.ferret_blocks(model) == (2048, 32, 320, 10)   # each tensor its own block at 0.9 × median = 158


def test_simulation_bytes_are_k_floats_and_full_rank_matches_fedavg():
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.5, seed=0)
    kw = dict(model="mlp", model_kwargs={"hidden": (4,)}, rounds=2, clients_per_round=None, local_epochs=1,
              batch_size=32, lr=0.1, seed=0, progress=False)
    d = 64 * 4 + 4 + 4 * 10 + 10
    h = fl.simulate(F.ferret(K=13), fed, **kw)
    assert (h["bytes_up"] == 4 * 13 * 4).all()           # 4 clients × K float32 coefficients, nothing else
    base = fl.simulate(fl.get_method("fedavg"), fed, **kw)
    assert (base["bytes_up"] == 4 * d * 4).all()
    full = fl.simulate(F.ferret(K=2 * d, estimator="lstsq", blocks=(256, 4, 40, 10)), fed, **kw)
    assert abs(full.final("test_acc") - base.final("test_acc")) < 1e-6


def test_bad_inputs():
    with pytest.raises(ValueError, match="K must be"):
        F.ferret(K=0)
    with pytest.raises(ValueError, match="estimator"):
        F.ferret(estimator="mean")
    with pytest.raises(ValueError, match="number of blocks"):
        F.ferret(K=2, blocks=(5, 5, 5))
    with pytest.raises(ValueError, match="blocks sum"):
        F.FerretSpec(K=4, blocks=(5, 5)).layout(11)
    with pytest.raises(ValueError, match=r"deltas must be \[m, d\]"):
        F.project(torch.zeros(2, 9), F.directions(0, (10,), (3,)))
    assert isinstance(F.ferret(), fl.methods.Method)  # builds with defaults
