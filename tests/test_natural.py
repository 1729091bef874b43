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


# --- AFL (agnostic federated learning), q-FFL's baseline in its Table 2 ------------------------------
def test_project_simplex_matches_a_threshold_search():
    from fedlab_nb.methods.heterogeneity.agnostic_fl import project_simplex
    assert torch.allclose(project_simplex(torch.tensor([2.0, 0.0])), torch.tensor([1.0, 0.0]))
    assert torch.allclose(project_simplex(torch.tensor([0.6, 0.6])), torch.tensor([0.5, 0.5]))
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        v = torch.randn(6, generator=g, dtype=torch.float64) * 2
        lo, hi = float(v.min()) - 1, float(v.max())       # Σ max(v − τ, 0) = 1 by bisection on τ
        for _ in range(200):
            tau = (lo + hi) / 2
            lo, hi = (tau, hi) if (v - tau).clamp_min(0).sum() > 1 else (lo, tau)
        assert torch.allclose(project_simplex(v), (v - lo).clamp_min(0), atol=1e-9)


def test_agnostic_fl_run_equals_a_hand_written_stochastic_afl():
    """One full-batch step a round: w ← w − η Σ λ_k ∇F_k(w), λ ← Proj(λ + γ F(w)), output the iterates' mean."""
    import fedlab_nb as fl
    from torch.func import functional_call
    from fedlab_nb.methods.heterogeneity.agnostic_fl import agnostic_fl, project_simplex
    from fedlab_nb.models import flatten_params, make_model, param_spec, unflatten
    rng = np.random.default_rng(0)
    clients = [(rng.normal(size=(n, 5)).astype(np.float32) + k, rng.integers(0, 3, n)) for k, n in enumerate((12, 20, 30))]
    fed = fl.FederatedDataset.from_clients(clients)
    torch.manual_seed(0)
    model = make_model("logistic", (5,), 3)
    w, spec = flatten_params(model).clone(), param_spec(model)
    lr, gamma, rounds = 0.3, 0.5, 4
    h = fl.simulate(agnostic_fl(gamma), fed, model=model, rounds=rounds, clients_per_round=None, local_steps=1,
                    batch_size=64, lr=lr, seed=0, progress=False, backend="loop")

    def loss(theta, x, y):
        return torch.nn.functional.cross_entropy(functional_call(model, unflatten(theta, spec), (x,)), y)
    data = [(torch.tensor(x), torch.tensor(y)) for x, y in clients]
    lam, iterates = torch.full((3,), 1 / 3, dtype=w.dtype), []
    for _ in range(rounds):
        grads = [torch.autograd.grad(loss(w.requires_grad_(), x, y), w)[0] for x, y in data]
        f = torch.stack([loss(w.detach(), x, y) for x, y in data]).detach()
        w = (w - lr * sum(l * g for l, g in zip(lam, grads))).detach()
        lam = project_simplex(lam + gamma * f)
        iterates.append(w)
    torch.testing.assert_close(h.theta, w, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h.state["rule"]["lambda"], lam, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h.state["rule"]["average"], torch.stack(iterates).mean(0), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(lam, torch.full_like(lam, 1 / 3))   # λ moved off the uniform mixture
    with pytest.raises(ValueError, match="lr_lambda must be"):
        agnostic_fl(0)
    with pytest.raises(ValueError, match="loss_on must be"):
        agnostic_fl(loss_on="all")


def test_qffl_batch_loss_is_the_official_q_fedsgd_step():
    """loss_on="batch" with one full-batch step: Δ_k = ∇F_k, h_k = q F_k^{q−1}‖∇F_k‖² + F_k^q / η (q-FedSGD)."""
    import fedlab_nb as fl
    from torch.func import functional_call
    from fedlab_nb.models import flatten_params, make_model, param_spec, unflatten
    rng = np.random.default_rng(1)
    clients = [(rng.normal(size=(n, 4)).astype(np.float32) * (k + 1), rng.integers(0, 2, n)) for k, n in enumerate((9, 15))]
    fed = fl.FederatedDataset.from_clients(clients)
    torch.manual_seed(0)
    model = make_model("logistic", (4,), 2)
    w, spec, lr, q = flatten_params(model).clone(), param_spec(model), 0.2, 3.0
    h = fl.simulate(qffl(q=q, loss_on="batch"), fed, model=model, rounds=1, clients_per_round=None, local_steps=1,
                    batch_size=64, lr=lr, seed=0, progress=False, backend="loop")
    num, den = 0, 0
    for x, y in clients:
        w_ = w.clone().requires_grad_()
        f = torch.nn.functional.cross_entropy(functional_call(model, unflatten(w_, spec), (torch.tensor(x),)), torch.tensor(y))
        g = torch.autograd.grad(f, w_)[0]
        f = f.detach() + 1e-10
        num, den = num + f ** q * g, den + q * f ** (q - 1) * g.pow(2).sum() + f ** q / lr
    torch.testing.assert_close(h.theta, w - num / den, atol=1e-5, rtol=1e-4)


@needs("adult")
def test_adult_phd_split_and_categorical_features():
    """The AFL / q-FFL comparison's Adult: 99 one-hot features (no numeric columns, no '?'), PhD vs the rest."""
    ds = nat.load_adult(group_by="phd", features="categorical")
    assert ds.x_train.shape[1] == 99 and set(ds.x_train.sum(1).tolist()) <= {5.0, 6.0, 7.0, 8.0}  # 8 attributes, up to 3 of them "?"
    assert (ds.groups_train == "phd").sum() == 413 and (ds.groups_test == "phd").sum() == 181  # education Doctorate
    with pytest.raises(ValueError, match="features must be"):
        nat.load_adult(features="numeric")
