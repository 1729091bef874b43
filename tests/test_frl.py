"""FRL (federated rank learning): rankings, the vote, masks, upload size, and a short deterministic run."""
import math

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.robustness.frl import (HonestMajoritySampler, client_rank_update, clients_rank_update, float_upload_bits,
                                   forward, make_supermask_net, mask_from_ranking, pack_ranking, rank_upload_bits,
                                   ranking_of, reputations, reverse_ranking, run_frl, scores_from_ranking, topk_mask,
                                   unpack_ranking, vote)


def test_reputation_is_position_in_ranking():
    assert reputations(torch.tensor([[2, 0, 1]])).tolist() == [[1, 2, 0]]


def test_vote_hand_made_borda_count():
    # positions: e0 = 0+0+2 = 2, e1 = 1+1+1 = 3, e2 = 2+2+0 = 4  -> ascending totals 0, 1, 2
    assert vote(torch.tensor([[0, 1, 2], [0, 1, 2], [2, 1, 0]])).tolist() == [0, 1, 2]
    # e0 = 1+1+0 = 2, e1 = 2+2+1 = 5, e2 = 0+0+2 = 2: the tie e0/e2 goes to the lower id
    assert vote(torch.tensor([[2, 0, 1], [2, 0, 1], [0, 1, 2]])).tolist() == [0, 2, 1]


def test_vote_of_one_client_is_its_ranking_and_majority_wins():
    r = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(vote(r[None]), r)
    # three identical honest votes beat two reversed ones: the honest top edge stays on top
    out = vote(torch.stack([r, r, r, reverse_ranking(r), reverse_ranking(r)]))
    assert out[-1] == r[-1] and out[0] == r[0]


def test_vote_rejects_non_permutations():
    with pytest.raises(ValueError, match="permutation"):
        vote(torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match=r"\[m, n\]"):
        vote(torch.tensor([0, 1, 2]))


def test_scores_from_ranking_is_the_inverse_of_ranking_of():
    scores = scores_from_ranking(torch.tensor([2, 0, 1]), torch.tensor([-1.0, 0.0, 5.0]))
    assert scores.tolist() == [0.0, 5.0, -1.0]
    assert ranking_of(scores).tolist() == [2, 0, 1]


@pytest.mark.parametrize("n", [10, 101, 8192])
@pytest.mark.parametrize("k", [0.5, 0.3, 0.1])
def test_mask_density_is_exactly_k(n, k):
    ranking = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    mask = mask_from_ranking(ranking, k)
    assert int(mask.sum()) == round(k * n)
    assert torch.equal(mask[ranking[-round(k * n):]], torch.ones(round(k * n)))  # the top of the ranking
    sorted_scores = torch.linspace(-1, 1, n)
    assert torch.equal(topk_mask(scores_from_ranking(ranking, sorted_scores), k), mask)


def test_topk_mask_rowwise():
    scores = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    mask = topk_mask(scores, 0.25)
    assert mask.sum(1).tolist() == [250.0] * 3
    for row, m in zip(scores, mask.bool()):
        assert row[m].min() > row[~m].max()


def test_upload_bits_formula_and_packing():
    assert rank_upload_bits([8, 9, 1000]) == 8 * 3 + 9 * 4 + 1000 * 10
    assert float_upload_bits([8, 9, 1000]) == 32 * 1017
    for n in (2, 9, 1000, 8192):
        r = torch.randperm(n, generator=torch.Generator().manual_seed(n))
        blob = pack_ranking(r)
        assert len(blob) == math.ceil(rank_upload_bits([n]) / 8)
        assert torch.equal(unpack_ranking(blob, n), r)


def test_straight_through_gradient_reaches_inactive_edges():
    net, ranking = make_supermask_net([4, 6, 3], k=0.5, seed=0)
    scores = [scores_from_ranking(r, s).requires_grad_(True) for r, s in zip(ranking, net.sorted_scores)]
    x, y = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0, 1])
    torch.nn.functional.cross_entropy(forward(net, scores, x), y).backward()
    off = topk_mask(scores[1].detach(), 0.5) == 0
    assert scores[1].grad[off].abs().sum() > 0  # edge-popup: unused edges still get a score gradient


def test_batched_clients_equal_one_at_a_time():
    net, ranking = make_supermask_net([8, 16, 4], k=0.5, seed=0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in (13, 7)]
    both = clients_rank_update(net, ranking, data, epochs=2, batch_size=4,
                               generators=[np.random.default_rng(i) for i in range(2)])
    for i, (x, y) in enumerate(data):
        alone = client_rank_update(net, ranking, x, y, epochs=2, batch_size=4, generator=np.random.default_rng(i))
        assert all(torch.equal(a, b) for a, b in zip(alone, both[i]))


def test_honest_majority_sampler():
    sampler = HonestMajoritySampler(4, malicious=(0, 1, 2))
    for r in range(50):
        ids = sampler(r, 8, np.random.default_rng(r))
        assert len(ids) == 4 and len(set(ids.tolist())) == 4 and np.isin(ids, [0, 1, 2]).sum() < 2


@pytest.fixture(scope="module")
def digits():
    return fl.federate("digits", "dirichlet", n_clients=20, alpha=1.0, seed=0)


def test_two_round_run_is_deterministic_and_learns(digits):
    a = run_frl(digits, hidden=(64,), rounds=2, clients_per_round=10, seed=3)
    b = run_frl(digits, hidden=(64,), rounds=2, clients_per_round=10, seed=3)
    assert a["test_acc"].tolist() == b["test_acc"].tolist()
    assert all(torch.equal(x, y) for x, y in zip(a.theta, b.theta))
    assert a.final("test_acc") > 0.2  # 10 classes: chance is 0.1
    assert a.meta["upload_bits"] == rank_upload_bits([64 * 64, 64 * 10])


def test_reversed_ranking_attackers_take_part(digits):
    hist = run_frl(digits, hidden=(32,), rounds=2, clients_per_round=10, malicious=range(4), seed=0)
    assert hist["n_malicious"].sum() > 0
    with pytest.raises(ValueError, match="honest majority"):
        run_frl(digits, hidden=(32,), rounds=1, malicious=range(10))
