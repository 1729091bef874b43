"""Fisher merging (fedlab_nb.methods.communication.fisher_merging): the merge's exact special cases and the Fisher itself."""
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.communication.fisher_merging import (FisherMergeRule, diagonal_fisher, fisher_merge, fisher_merging,
                                              fisher_merging_method, fisher_rows)
from fedlab_nb.models import flatten_params, load_flat, make_model


def _models(k=4, d=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, d, generator=g, dtype=torch.float64), torch.rand(k, d, generator=g, dtype=torch.float64)


def test_equal_fishers_give_the_plain_average():
    thetas, _ = _models()
    lam = torch.tensor([3.0, 1.0, 7.0, 5.0], dtype=torch.float64)
    plain = ((lam / lam.sum())[:, None] * thetas).sum(0)
    for c in (1.0, 0.25, 8.0):  # powers of two: c cancels exactly, bitwise
        assert torch.equal(fisher_merge(thetas, torch.full_like(thetas, c), lam), plain)
    for c in (0.3, 1e-3, 17.0):  # any c: equal up to rounding of c·λ
        assert (fisher_merge(thetas, torch.full_like(thetas, c), lam) - plain).abs().max() < 1e-14
    # below the floor every Fisher becomes ε: the plain average again
    assert (fisher_merge(thetas, torch.zeros_like(thetas), lam) - plain).abs().max() < 1e-14


def test_one_client_merges_to_its_own_model_exactly():
    thetas, fishers = _models(k=1)
    assert torch.equal(fisher_merge(thetas, fishers, torch.tensor([5.0])), thetas[0])
    assert torch.equal(fisher_merge(thetas, fishers, normalize=True), thetas[0])


def test_the_merge_weights_each_parameter_by_its_fisher():
    thetas = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    fishers = torch.tensor([[3.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    assert torch.allclose(fisher_merge(thetas, fishers), torch.tensor([0.25, 0.5], dtype=torch.float64), rtol=0, atol=1e-15)


def _loop_fisher(model, theta, x, y, kind):
    """Reference: one example and one class at a time, autograd on a copy of the model."""
    load_flat(model, theta)
    total = torch.zeros_like(theta)
    for xi, yi in zip(x, y):
        logp = torch.log_softmax(model(xi[None])[0], -1)
        classes = range(len(logp)) if kind == "exact" else [int(yi)]
        for c in classes:
            g = torch.autograd.grad(logp[c], list(model.parameters()), retain_graph=True)
            g = torch.cat([t.reshape(-1) for t in g])
            total += (logp[c].exp().detach() if kind == "exact" else 1.0) * g.square()
    return total / len(x)


@pytest.mark.parametrize("kind", ["exact", "empirical"])
def test_fisher_equals_the_mean_squared_per_sample_gradient_of_a_loop(kind):
    torch.manual_seed(0)
    model = make_model("mlp", (6,), 4, hidden=(5,)).double()
    theta = flatten_params(model).clone()
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 4, (9,))
    fast = diagonal_fisher(model, theta, x, y, kind, chunk=4)  # chunks: 4 + 4 + 1 rows
    slow = _loop_fisher(model, theta, x, y, kind)
    assert (fast - slow).abs().max() <= 1e-12 * slow.abs().max()


def test_one_shot_run_with_equal_fishers_is_one_round_of_fedavg():
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.5, seed=0)
    kw = dict(local_epochs=2, lr=0.1, batch_size=32, seed=0)
    fm = fisher_merging(fed, "logreg", floor=1e9, **kw)  # floor above every Fisher: all F̃_k = floor
    avg = fl.simulate("fedavg", fed, "logreg", rounds=1, clients_per_round=None, progress=False, **kw)
    assert (fm.theta - avg.theta).abs().max() < 1e-5  # float32: θ + mean Δ vs Σ p_k θ_k
    assert fm["bytes_up"].iloc[0] == 2 * avg["bytes_up"].iloc[0]  # model + Fisher


def test_fisher_rows_are_all_or_evenly_spaced():
    assert fisher_rows(5, None).tolist() == [0, 1, 2, 3, 4] and fisher_rows(5, 10).tolist() == [0, 1, 2, 3, 4]
    assert fisher_rows(101, 3).tolist() == [0, 50, 100]


def test_clear_errors():
    thetas, fishers = _models()
    with pytest.raises(ValueError, match="one shape"):
        fisher_merge(thetas, fishers[:, :3])
    with pytest.raises(ValueError, match="negative"):
        fisher_merge(thetas, -fishers)
    with pytest.raises(ValueError, match="floor"):
        fisher_merge(thetas, fishers, floor=-1)
    with pytest.raises(ValueError, match="zero total Fisher"):
        fisher_merge(thetas, torch.zeros_like(fishers), floor=0)
    with pytest.raises(ValueError, match="merging coefficients"):
        fisher_merge(thetas, fishers, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    model = make_model("logreg", (3,), 2)
    with pytest.raises(ValueError, match="kind"):
        diagonal_fisher(model, flatten_params(model), torch.zeros(2, 3), kind="sampled")
    with pytest.raises(ValueError, match="labels y"):
        diagonal_fisher(model, flatten_params(model), torch.zeros(2, 3), kind="empirical")
    with pytest.raises(ValueError, match="n_fisher"):
        fisher_merging_method(n_fisher=0)
    with pytest.raises(ValueError, match="'fisher' message"):
        FisherMergeRule()(thetas, None)
