"""Distributed 1-NN with a majority vote (fedlab_nb/methods/communication/knn_vote.py)."""
import pytest
import torch
from sklearn.neighbors import KNeighborsClassifier

from fedlab_nb.methods.communication import knn_vote as kv


def _data(n=300, q=80, d=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + q, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n + q,), generator=g)
    return x[:n], y[:n], x[n:], y[n:]


def test_one_group_is_exactly_1nn():
    x, y, xq, _ = _data()
    res = kv.distributed_1nn(x, y, xq, M=1, num_classes=3, generator=torch.Generator().manual_seed(1))
    idx, _ = kv.nearest_neighbour(x, xq)
    assert torch.equal(res.prediction, y[idx])
    sk = KNeighborsClassifier(n_neighbors=1, algorithm="brute").fit(x.numpy(), y.numpy())
    assert (res.prediction.numpy() == sk.predict(xq.numpy())).all()


def test_vote_matches_hand_computation_with_ties():
    votes = torch.tensor([[0, 2, 1, 1],
                          [1, 2, 1, 0],
                          [1, 0, 2, 2],
                          [0, 0, 2, 2]])
    # column 0: 0,1,1,0 -> tie 0/1 -> 0; column 1: 2,2,0,0 -> tie -> 0; column 2: 1,1,2,2 -> tie -> 1;
    # column 3: 1,0,2,2 -> 2 wins
    assert kv.majority_vote(votes, 3).tolist() == [0, 0, 1, 2]
    # the official binary rule: class 1 iff mean vote > 1/2
    binary = torch.tensor([[0, 1, 1], [1, 1, 0], [1, 0, 0], [0, 1, 0]])
    assert kv.majority_vote(binary, 2).tolist() == (binary.double().mean(0) > 0.5).long().tolist()


def test_selective_vote_keeps_the_closest_groups():
    votes = torch.tensor([[1], [1], [0], [0], [0]])
    dists = torch.tensor([[0.1], [0.2], [0.9], [0.8], [0.7]])
    assert kv.majority_vote(votes, 2).tolist() == [0]
    assert kv.selective_vote(votes, dists, 2, select_ratio=0.4).tolist() == [1]  # L = 2: the two closest
    assert kv.selective_vote(votes, dists, 2, select_ratio=1.0).tolist() == [0]  # L = M: the plain vote


def test_distributed_vote_is_hand_vote_of_group_1nn():
    x, y, xq, _ = _data(seed=3)
    res = kv.distributed_1nn(x, y, xq, M=7, num_classes=3, generator=torch.Generator().manual_seed(5))
    by_hand = []
    for g in res.groups:
        idx, _ = kv.nearest_neighbour(x[g], xq)
        by_hand.append(y[g][idx])
    assert torch.equal(res.votes.long(), torch.stack(by_hand))
    assert torch.equal(res.prediction, kv.majority_vote(torch.stack(by_hand), 3))
    train_dist = torch.cdist(x, xq)  # the precomputed-distance path gives the same answer
    again = kv.distributed_1nn(x, y, xq, M=7, num_classes=3, generator=torch.Generator().manual_seed(5),
                               train_dist=train_dist)
    assert torch.equal(again.prediction, res.prediction)


@pytest.mark.parametrize("k", [1, 4, 15])
def test_exact_knn_matches_sklearn(k):
    x, y, xq, _ = _data(seed=k)
    ours = kv.knn_predict(x, y, xq, k, num_classes=3)
    sk = KNeighborsClassifier(n_neighbors=k, algorithm="brute").fit(x.numpy(), y.numpy())
    assert (ours.numpy() == sk.predict(xq.numpy())).all()


def test_groups_partition():
    groups = kv.random_groups(103, 10, torch.Generator().manual_seed(0))
    allidx = torch.cat(groups)
    assert sorted(allidx.tolist()) == list(range(103))
    sizes = [len(g) for g in groups]
    assert len(groups) == 10 and max(sizes) - min(sizes) <= 1


def test_bytes_are_the_encoded_votes():
    x, y, xq, _ = _data()
    res = kv.distributed_1nn(x, y, xq, M=5, num_classes=3)
    assert res.votes.dtype == torch.uint8 and res.bytes_up == 5 * len(xq)
    sel = kv.distributed_1nn(x, y, xq, M=5, num_classes=3, rule="selective")
    assert sel.bytes_up == 5 * len(xq) * (1 + 4)


def test_bayes_error_closed_form():
    x, y = kv.two_gaussians(200_000, generator=torch.Generator().manual_seed(0))
    bayes_pred = (x.sum(1) > 2.5).long()  # equal covariances: the boundary is the midpoint hyperplane
    assert abs((bayes_pred != y).double().mean().item() - kv.two_gaussians_bayes_error()) < 0.003


def test_clear_errors():
    x, y, xq, _ = _data(n=20)
    with pytest.raises(ValueError, match="M <= n"):
        kv.distributed_1nn(x, y, xq, M=21, num_classes=3)
    with pytest.raises(ValueError, match="M .* >= 1"):
        kv.distributed_1nn(x, y, xq, M=0, num_classes=3)
    with pytest.raises(ValueError, match="train_dist"):
        kv.distributed_1nn(x, y, xq, M=2, num_classes=3, train_dist=torch.cdist(xq, x))
    with pytest.raises(ValueError, match="rule"):
        kv.distributed_1nn(x, y, xq, M=2, num_classes=3, rule="mean")
    with pytest.raises(ValueError, match="k must be"):
        kv.knn_predict(x, y, xq, 0, num_classes=3)
    with pytest.raises(ValueError, match="select_ratio"):
        kv.selective_vote(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 2, select_ratio=0)


def test_regression_form():
    x, y, xq, _ = _data(seed=7)
    yf = torch.randn(len(y), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    groups = kv.random_groups(len(y), 1)
    one = kv.distributed_1nn_regress(yf, torch.cdist(x, xq), groups)
    idx, _ = kv.nearest_neighbour(x, xq)
    assert torch.equal(one, yf[idx])  # M = 1: 1-NN regression
    from sklearn.neighbors import KNeighborsRegressor
    sk = KNeighborsRegressor(n_neighbors=6, algorithm="brute").fit(x.numpy(), yf.numpy()).predict(xq.numpy())
    assert torch.allclose(kv.knn_regress(yf, torch.cdist(xq, x), 6), torch.from_numpy(sk), atol=1e-12)
    groups = kv.random_groups(len(y), 4, torch.Generator().manual_seed(1))
    by_hand = torch.stack([yf[g][kv.nearest_neighbour(x[g], xq)[0]] for g in groups]).mean(0)
    assert torch.allclose(kv.distributed_1nn_regress(yf, torch.cdist(x, xq), groups), by_hand)


def test_eta_closed_form():
    x = torch.randn(50, 5, dtype=torch.float64)
    from scipy.stats import multivariate_normal
    p0 = multivariate_normal(torch.zeros(5).numpy()).pdf(x.numpy())
    p1 = multivariate_normal(torch.ones(5).numpy()).pdf(x.numpy())
    assert torch.allclose(kv.two_gaussians_eta(x), torch.from_numpy(p1 / (p0 + p1)), atol=1e-10)
