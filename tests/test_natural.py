"""Natural partitions: the Adult and Shakespeare loaders on the set-up's archives, and q-FFL's update."""
import numpy as np
import pytest
import torch

from fedlab_nb.data import DatasetNotAvailable
from fedlab_nb.data import natural_data as nat
from fedlab_nb.core.method import Method, LocalObjective, ServerSGD, UniformWeighting, weighted_mean
from fedlab_nb.methods.heterogeneity.qffl import qffl, qffl_step


def _have(name):
    try:
        nat._archive(name, None)
        return True
    except DatasetNotAvailable:
        return False


needs = lambda name: pytest.mark.skipif(not _have(name), reason=f"{name} archive not in the data root: run "
                                        "`bash scripts/setup.sh` (fedlab_nb.data.natural_data.fetch_natural)")


@needs("adult")
def test_adult_rows_labels_and_groups():
    ds = nat.load_adult(group_by="sex")
    assert (len(ds.y_train), len(ds.y_test)) == (32_561, 16_281)
    assert 0.23 < ds.y_train.float().mean() < 0.25 and 0.23 < ds.y_test.float().mean() < 0.25  # 7,841 / 3,846 >50K
    assert set(ds.groups_train) == {"Male", "Female"} and len(ds.groups_train) == len(ds.y_train)
    assert ds.x_train.shape[1] == ds.x_test.shape[1] and torch.isfinite(ds.x_train).all()
    from fedlab_nb.data import federate
    fed = federate(ds, "natural", n_clients=None)
    rows = np.concatenate([np.concatenate([a, b]) for a, b in zip(fed.train_idx, fed.test_idx)])
    assert np.array_equal(np.sort(rows), np.arange(len(ds.y_train)))  # the groups partition the rows


@needs("adult")
def test_adult_country_merges_small_groups_and_rejects_bad_key():
    ds = nat.load_adult(group_by="country", min_group_size=100)
    counts = {g: int((ds.groups_train == g).sum()) for g in set(ds.groups_train)}
    assert "Other" in counts and min(counts.values()) >= 100 and counts["United-States"] == 29_170
    with pytest.raises(ValueError, match="group_by"):
        nat.load_adult(group_by="age")


@needs("shakespeare")
def test_shakespeare_clients_windows_and_vocabulary():
    ds = nat.load_shakespeare(seq_len=10, stride=10, max_clients=20, min_chars=2000, max_windows=30, seed=1)
    roles = nat.shakespeare_roles()
    assert len(roles) > 1000 and ("hamlet", "Ham") in roles
    clients = ds.meta["clients"]
    assert len(clients) == 20 and set(ds.groups_train) == set(clients)
    assert ds.num_classes == len(nat.VOCAB) == 95
    play, role = clients[0].split("/")
    rows = np.flatnonzero(ds.groups_train == clients[0])
    text = roles[(play, role)]
    for i, r in enumerate(rows[:5]):  # window i is text[10 i : 10 i + 10], its label the next character
        assert nat.decode(ds.x_train[r]) == text[10 * i: 10 * i + 10]
        assert nat.decode(ds.y_train[r:r + 1]) == text[10 * i + 10]


def test_speaker_parsing_and_errors(tmp_path):
    text = "ACT I.\n\nHam.\nTo be, or not\nto be.\n\nHor.\nMy lord.\n\nHam.\nAy.\n"
    assert nat.parse_roles(text) == {"Ham": "To be, or not to be. Ay.", "Hor": "My lord."}
    assert nat.decode(nat.encode("a b~")) == "a b~" and nat.normalise("é\n x") == "? x"
    with pytest.raises(DatasetNotAvailable, match="fetch_natural|data fetch"):
        nat.load_adult(root=str(tmp_path))
    with pytest.raises(ValueError, match="seq_len"):
        nat.load_shakespeare(root=str(tmp_path), seq_len=0)


def test_qffl_q0_is_uniform_fedavg_and_q_shifts_weight_to_high_loss():
    g = torch.Generator().manual_seed(0)
    deltas, losses, lr = torch.randn(4, 7, generator=g, dtype=torch.float64), torch.tensor([.5, 1., 2., 4.]), 0.1
    assert torch.allclose(qffl_step(deltas, losses, q=0.0, lipschitz=1 / lr), deltas.mean(0))
    # q > 0 by hand: Δ_k = L(w − w̄_k), h_k = q F^{q−1}‖Δ_k‖² + L F^q, step = −Σ F^q Δ_k / Σ h_k
    L, q, f = 1 / lr, 2.0, losses.double() + 1e-10
    D = -L * deltas
    h = q * f ** (q - 1) * (D ** 2).sum(1) + L * f ** q
    assert torch.allclose(qffl_step(deltas, losses, q, L), -(f[:, None] ** q * D).sum(0) / h.sum())


def test_qffl_q0_run_equals_uniform_fedavg_run():
    import fedlab_nb as fl
    rng = np.random.default_rng(0)
    clients = [(rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, n)) for n in (20, 35, 50)]
    fed = fl.FederatedDataset.from_clients(clients)
    uniform = Method("uniform", LocalObjective(), UniformWeighting(), weighted_mean, ServerSGD(1.0))
    kw = dict(model="logistic", rounds=3, clients_per_round=None, local_epochs=1, batch_size=8, lr=0.1, seed=0,
              progress=False)
    a, b = fl.simulate(qffl(q=0.0), fed, **kw), fl.simulate(uniform, fed, **kw)
    assert torch.allclose(a.theta, b.theta, atol=1e-5)
    with pytest.raises(ValueError, match="q must be"):
        qffl(q=-1)
