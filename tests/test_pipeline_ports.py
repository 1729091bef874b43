"""The special loops on the round pipeline: FRL (rankings, vote, ServerAssign), FedAU's quadratic clients
(a user-given loss on float64 regression targets), and `FederatedDataset.from_clients`."""
import math

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.engine import simulate
from fedlab_nb.engine.sampling import BernoulliSampler
from fedlab_nb.methods.robustness import frl
from fedlab_nb.methods.weights.fedau import fedau, fedavg_participants, known_probability, quadratic_run
from fedlab_nb.utils import rng


@pytest.fixture(scope="module")
def digits():
    return fl.federate("digits", "dirichlet", n_clients=12, alpha=1.0, seed=0)


def test_frl_global_scores_stay_a_permutation_of_the_initial_ones(digits):
    model = frl.SupermaskMLP([64, 32, 10], k=0.5, seed=1)
    sizes = model.layer_sizes
    initial = [s.detach().sort().values for s in frl._layers(torch.cat([p.detach() for p in model.parameters()]), sizes)]
    seen = []

    def check(r, theta, row):
        seen.append(r)
        for s, s0 in zip(frl._layers(theta, sizes), initial):
            assert torch.equal(s.sort().values, s0)

    bad = (0, 1, 2)
    simulate(frl.frl_method(model), digits, model, rounds=3, clients_per_round=frl.HonestMajoritySampler(6, bad),
             local_epochs=1, batch_size=8, lr=0.4, attack=frl.ReversedVoteAttack(tuple(sizes)), byzantine=bad,
             callback=check, progress=False)
    assert seen == [1, 2, 3]


def test_frl_bytes_up_is_the_packed_ranking_size(digits):
    hist = frl.run_frl(digits, hidden=(32,), rounds=2, clients_per_round=5, seed=0)
    sizes = hist.model.layer_sizes
    per_client = sum(len(frl.pack_ranking(torch.randperm(n))) for n in sizes)
    assert per_client == sum(math.ceil(frl.rank_upload_bits([n]) / 8) for n in sizes)
    assert hist["bytes_up"].tolist() == [5 * per_client] * 2
    # the transform measures what it encodes: the real rankings of a round
    from fedlab_nb.core.messages import Messages
    rows = torch.stack([torch.cat([torch.randperm(n) for n in sizes]) for _ in range(3)])
    msgs, _ = frl.PackedRankingBytes(tuple(sizes))(Messages({"ranking": rows}, np.arange(3)), {}, None)
    assert msgs.bytes.tolist() == [sum(len(frl.pack_ranking(r)) for r in frl._layers(row, sizes)) for row in rows]
    assert all(torch.equal(torch.sort(r).values, torch.arange(n)) for r, n in zip(hist.theta, sizes))


def _closed_form(method, centers, probabilities, rounds, local_steps, lr, seed):
    """The previous implementation: Δ = (1 − (1 − η)^τ)(c − x) for the round's participants."""
    centers = torch.as_tensor(np.asarray(centers, dtype=float))
    n, d = centers.shape
    sampler = BernoulliSampler(np.asarray(probabilities, dtype=float))
    shrink = 1 - (1 - lr) ** local_steps
    x = torch.zeros(d, dtype=torch.float64)
    state = method.init_state(x, n)
    xs = np.empty((rounds, d))
    for r in range(rounds):
        ids = sampler(r, n, rng(seed, 1, r))
        if len(ids):
            ones = torch.ones(len(ids), dtype=torch.float64)
            agg, state = method.aggregate(state, shrink * (centers[ids] - x), RoundInfo(r, ids, ones, local_steps * ones, n, lr))
            x, state = method.server_step(state, x, agg)
        xs[r] = x.numpy()
    return xs, state


@pytest.mark.parametrize("make", [lambda p: fedau(10), lambda p: fedavg_participants(), lambda p: known_probability(p)])
def test_quadratic_run_on_the_pipeline_equals_the_closed_form(make):
    g = np.random.default_rng(0)
    centers, p = g.normal(size=(12, 3)), np.linspace(0.1, 0.9, 12)
    want, want_state = _closed_form(make(p), centers, p, rounds=60, local_steps=3, lr=0.2, seed=4)
    out = quadratic_run(make(p), centers, p, rounds=60, local_steps=3, lr=0.2, seed=4)
    assert out["x"].dtype == np.float64
    np.testing.assert_allclose(out["x"], want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out["dist"], np.linalg.norm(want - centers.mean(0), axis=1), atol=1e-12)
    for k, v in want_state["weighting"].items():
        assert torch.equal(out["state"]["weighting"][k], v)


def test_from_clients_regression_and_classification():
    reg = FederatedDataset.from_clients([(np.ones((2, 1)), np.zeros((2, 3))), (np.ones((1, 1)), np.ones((1, 3)))])
    assert reg.num_clients == 2 and reg.sizes.tolist() == [2, 1] and reg.num_classes == 3
    assert reg.client_train[1][1].dtype == torch.float64 and len(reg.client_test[0][1]) == 0
    assert "FederatedDataset" in repr(reg)
    cls = FederatedDataset.from_clients([(np.random.rand(4, 2), np.array([0, 1, 1, 0])), (np.random.rand(3, 2), np.array([2, 2, 0]))])
    assert cls.num_classes == 3 and cls.label_histogram().tolist() == [[2, 2, 0], [1, 0, 2]]
    with pytest.raises(ValueError, match="labels outside"):
        FederatedDataset.from_clients([(np.random.rand(2, 2), np.array([0, 5]))], num_classes=3)
