"""FedAU (fedlab_nb.methods.weights.fedau): the participation-interval weights, the oracle, the unnormalised sum, and
the bias picture on quadratic clients."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.engine.sampling import BernoulliSampler
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.methods.weights.fedau import (FedAUWeighting, KnownProbabilityWeighting, fedau, fedavg_participants,
                                     known_probability, quadratic_run, truncated_inverse, weighted_sum)


def info(r, ids, n):
    ids = np.asarray(ids, dtype=np.int64)
    ones = torch.ones(len(ids))
    return RoundInfo(r, ids, ones, ones, n, 0.1)


def per_round_reference(participation: np.ndarray, cutoff: int):
    """The official code's per-round bookkeeping (counter of misses, list of intervals), written plainly:
    returns the weight each participant got in each round, {(round, client): ω}."""
    t_max, n = participation.shape
    misses, intervals, used = [0] * n, [[] for _ in range(n)], {}
    for t in range(t_max):
        for k in range(n):
            if participation[t, k]:
                used[t, k] = float(np.mean(intervals[k])) if intervals[k] else 1.0
                intervals[k].append(misses[k] + 1)
                misses[k] = 0
            else:
                misses[k] += 1
                if misses[k] >= cutoff:
                    intervals[k].append(misses[k])
                    misses[k] = 0
    return used


def drive(weighting, participation):
    """Feed a weighting only the rounds that have participants, as the engine does."""
    n = participation.shape[1]
    state, got = weighting.init_state(torch.zeros(1), n), {}
    for t, row in enumerate(participation):
        ids = np.flatnonzero(row)
        if len(ids):
            w, state = weighting(state, info(t, ids, n))
            for k, wk in zip(ids, w.tolist()):
                got[t, k] = wk * n
    return got, state


@pytest.mark.parametrize("cutoff", [1, 3, 10])
def test_lazy_bookkeeping_equals_per_round_counter(cutoff):
    g = np.random.default_rng(cutoff)
    participation = g.random((300, 6)) < np.array([0.02, 0.05, 0.1, 0.3, 0.6, 1.0])
    participation[40:80] = False                                 # a stretch of rounds with no participant at all
    got, _ = drive(FedAUWeighting(cutoff), participation)
    want = per_round_reference(participation, cutoff)
    assert got.keys() == want.keys()
    assert np.allclose([got[k] for k in want], [want[k] for k in want])


def test_interval_estimate_converges_to_inverse_p():
    p = np.array([0.05, 0.1, 0.25, 0.5])
    participation = np.random.default_rng(0).random((6000, len(p))) < p
    _, state = drive(FedAUWeighting(cutoff=1000), participation)
    est = FedAUWeighting.estimates(state)
    assert np.allclose(est, 1 / p, rtol=0.15)                    # ≈ 3 standard errors for the rarest client
    always = np.ones((50, 2), dtype=bool)
    assert (FedAUWeighting.estimates(drive(FedAUWeighting(5), always)[1]) == 1.0).all()  # every interval is 1


def test_cutoff_truncates_rare_clients():
    p = np.array([0.01, 0.02, 0.2])
    participation = np.random.default_rng(1).random((15000, len(p))) < p
    _, state = drive(FedAUWeighting(cutoff=20), participation)
    est = FedAUWeighting.estimates(state)
    assert (est <= 20).all()
    assert np.allclose(est, truncated_inverse(p, 20), rtol=0.08)  # E[min(interval, K)], well below 1/p
    assert est[0] < 0.5 / p[0]


def test_first_participation_and_never_seen():
    w = FedAUWeighting(cutoff=5)
    state = w.init_state(torch.zeros(1), 4)
    weights, state = w(state, info(0, [0], 4))
    assert torch.allclose(weights, torch.tensor([0.25]))          # no interval yet → ω = 1, divided by N = 4
    weights, state = w(state, info(12, [0, 1], 4))               # client 1: 12 misses = 2 cutoff intervals
    assert torch.allclose(weights * 4, torch.tensor([11 / 3, 5.0]))  # intervals: client 0 [1, 5, 5], client 1 [5, 5]
    assert FedAUWeighting.estimates(state)[3] == 1.0              # never seen: default 1
    with pytest.raises(ValueError, match="round"):
        w(state, info(12, [0], 4))                                # same round twice


def test_bad_parameters():
    with pytest.raises(ValueError, match="cutoff"):
        FedAUWeighting(cutoff=0)
    with pytest.raises(ValueError, match="probabilities"):
        KnownProbabilityWeighting(np.array([0.5, 0.0])).init_state(torch.zeros(1), 2)
    with pytest.raises(ValueError, match="non-negative"):
        weighted_sum(torch.ones(2, 3), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="lr"):
        quadratic_run(fedau(), np.zeros((3, 2)), np.full(3, 0.5), lr=2.0)


def test_sum_rule_and_oracle_weights():
    updates = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert torch.equal(weighted_sum(updates, torch.tensor([0.5, 0.25])), torch.tensor([0.5, 0.5]))
    w, _ = KnownProbabilityWeighting(np.array([0.5, 0.25, 1.0]))({}, info(3, [0, 1], 3))
    assert torch.allclose(w, torch.tensor([2 / 3, 4 / 3]))


def test_quadratic_bias_picture():
    n = 40
    centers = np.zeros((n, 2))
    centers[:, 0] = np.linspace(-2, 2, n)
    p = np.linspace(0.05, 0.5, n)
    tail = {name: quadratic_run(m, centers, p, rounds=1500, seed=0)["x"][-500:].mean(0)
            for name, m in [("avg", fedavg_participants()), ("au", fedau(50)), ("oracle", known_probability(p))]}
    x_star = centers.mean(0)
    dist = {k: np.linalg.norm(v - x_star) for k, v in tail.items()}
    biased = (p[:, None] * centers).sum(0) / p.sum()
    assert np.linalg.norm(tail["avg"] - biased) < 0.1            # FedAvg sits at the p-weighted mean
    assert dist["au"] < 0.25 * dist["avg"] and dist["oracle"] < 0.25 * dist["avg"]


def test_runs_in_the_engine_with_a_bernoulli_sampler():
    fed = fl.federate("digits", "iid", n_clients=8, seed=0, test_fraction=0.0)
    p = np.linspace(0.1, 0.9, 8)
    hist = fl.simulate(fedau(cutoff=10), fed, model="logreg", rounds=6, clients_per_round=BernoulliSampler(p),
                       local_steps=2, batch_size=16, lr=0.1, seed=0, backend="loop", progress=False)
    assert len(hist) == 6 and np.isfinite(hist.final("test_acc"))
