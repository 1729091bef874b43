"""Tests of the FAIR-BFL contribution / reward / Shapley / ledger pieces (fedlab_nb/methods/more/fair_bfl.py)."""
import copy
import itertools
import math

import numpy as np
import pytest
import torch

from fedlab_nb.methods.more.fair_bfl import (Ledger, contribution_scores, detection_auroc, digest, reward_shares,
                                        shapley_values)


def test_scores_are_cosines_to_the_aggregate():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(5, 7, generator=g, dtype=torch.float64)
    agg = u.mean(0)
    expected = torch.nn.functional.cosine_similarity(u, agg[None], dim=1)
    assert torch.allclose(contribution_scores(u, leave_one_out=False), expected, atol=1e-12)
    u[4] = -3 * u[:4].sum(0)            # an attacker that cancels the others flips its own sign too
    assert contribution_scores(u, leave_one_out=False).shape == (5,)


def test_default_scores_are_cosines_to_the_other_clients_aggregate():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(5, 7, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 3.0, 1.0, 3.0], dtype=torch.float64)
    for k in range(5):
        others = [j for j in range(5) if j != k]
        ref = (w[others, None] * u[others]).sum(0) / w[others].sum()
        expected = torch.nn.functional.cosine_similarity(u[k], ref, dim=0)
        assert abs(contribution_scores(u, w)[k] - expected) < 1e-12
    # two aligned attackers that outweigh the honest mass: the self-inclusive score pays them, leave-one-out does not
    honest = torch.tensor([[1.0, 0.3], [1.0, -0.3], [1.0, 0.0], [0.8, 0.5]], dtype=torch.float64)
    u = torch.cat([honest, -2.0 * honest[2:3], -2.0 * honest[2:3]])
    inclusive, loo = contribution_scores(u, leave_one_out=False), contribution_scores(u)
    assert (inclusive[4:] > 0).all() and inclusive[4:].min() > inclusive[:3].max()
    assert loo[4:].max() < loo[:4].min()
    assert contribution_scores(u[:1]).item() == pytest.approx(1.0)          # one update: its own reference


def test_reward_budget_is_conserved_and_negative_scores_get_nothing():
    r = reward_shares([0.5, -0.2, 0.25, 0.0], budget=10.0)
    assert abs(r.sum() - 10.0) < 1e-12
    assert r[1] == 0 and r[3] == 0 and r[0] == pytest.approx(2 * r[2])
    assert np.allclose(reward_shares([-1.0, -2.0], budget=4.0), [2.0, 2.0])   # nobody positive: equal split
    with pytest.raises(ValueError, match="budget"):
        reward_shares([1.0], budget=0)


def _shapley_by_permutations(v, n):
    phi = np.zeros(n)
    for order in itertools.permutations(range(n)):
        seen = ()
        for k in order:
            phi[k] += v(tuple(sorted(seen + (k,)))) - v(tuple(sorted(seen)))
            seen = seen + (k,)
    return phi / math.factorial(n)


def test_shapley_matches_the_permutation_definition_and_is_efficient():
    rng = np.random.default_rng(1)
    table = {c: rng.random() for r in range(5) for c in itertools.combinations(range(4), r)}
    phi, values = shapley_values(table.__getitem__, 4)
    assert np.allclose(phi, _shapley_by_permutations(table.__getitem__, 4), atol=1e-12)
    assert abs(phi.sum() - (values[(0, 1, 2, 3)] - values[()])) < 1e-12
    additive, _ = shapley_values(lambda c: sum(2.0 ** k for k in c), 3)    # additive game: φ_k = own value
    assert np.allclose(additive, [1, 2, 4])
    with pytest.raises(ValueError, match="n_players"):
        shapley_values(lambda c: 0.0, 13)


def test_ledger_detects_any_edit_of_a_past_record():
    ledger = Ledger()
    for t in range(4):
        ledger.append(t, digest(torch.full((2, 3), float(t))), [0.1 * t, 0.2], [0.3, 0.7])
    assert ledger.verify()
    for i, key in itertools.product(range(4), ["round", "prev", "update", "scores", "rewards", "hash"]):
        forged = copy.deepcopy(ledger)
        rec = forged.records[i]
        rec[key] = rec[key] + 1 if key == "round" else (
            [rec[key][0] + 1e-9] + rec[key][1:] if isinstance(rec[key], list) else ("1" if rec[key][0] != "1" else "2") + rec[key][1:])
        assert not forged.verify(), (i, key)


def test_detection_auroc_uses_low_scores():
    assert detection_auroc([0.9, 0.8, -0.5, 0.7], [0, 0, 1, 0]) == 1.0
    with pytest.raises(ValueError, match="malicious"):
        detection_auroc([0.1, 0.2], [0, 0])


def test_rule_logs_scores_rewards_and_discards_negative_updates():
    from fedlab_nb.core.method import RoundInfo
    from fedlab_nb.methods.more.fair_bfl import FairBFLRule
    u = torch.tensor([[1.0, 0.0], [1.0, 0.2], [-0.5, 0.0]])
    info = RoundInfo(round=0, client_ids=np.arange(3), sizes=torch.ones(3), steps=torch.ones(3), num_clients=3,
                     lr=0.1, theta=torch.zeros(2))
    rule = FairBFLRule(budget=2.0, discard_below=0.0)
    agg, state = rule.aggregate(rule.init_state(torch.zeros(2), 3), u, torch.ones(3), info)
    assert torch.allclose(agg, u[:2].mean(0))                       # the negative-score update is left out
    assert state["reward"][2] == 0 and abs(state["reward"].sum() - 2.0) < 1e-12
    assert state["ledger"].verify() and len(state["ledger"].records) == 1
    assert set(rule.metrics(state)) >= {"bfl_score0", "bfl_reward2", "bfl_shapley1"}
