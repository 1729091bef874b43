"""Hash bagging and the collective certificate (fedlab_nb/methods/beyond/hash_bagging.py): BILP = brute force."""
import math

import numpy as np
import pytest

from fedlab_nb.methods.beyond import hash_bagging as hb


def tiny(rng, C, k=8, n=30, T=12):
    subsets = [rng.choice(n, int(rng.integers(3, 8)), replace=False) for _ in range(k)]
    main = rng.integers(0, C, T)
    votes = np.where(rng.random((k, T)) < 0.7, main[None], rng.integers(0, C, (k, T)))
    return hb.membership(subsets, n), votes


def test_bilp_equals_brute_force_vanilla_and_hash():
    rng = np.random.default_rng(0)
    for trial in range(6):
        C = 2 + trial % 2
        member, votes = tiny(rng, C)
        for P in (1, 2, 3):
            for threat in (hb.Threat(P, patterns=hb.poison_patterns(member)),
                           hb.Threat(P, rounds=[[0, 1, 2, 3], [4, 5, 6, 7]])):
                assert hb.max_simultaneous_flips(votes, C, threat).flips == hb.brute_force_max_flips(votes, C, threat)


def test_merged_patterns_lose_no_attack():
    rng = np.random.default_rng(1)
    member, votes = tiny(rng, 3)
    for P in (1, 2):
        full = hb.brute_force_max_flips(votes, 3, hb.Threat(P, patterns=member))
        assert full == hb.brute_force_max_flips(votes, 3, hb.Threat(P, patterns=hb.poison_patterns(member)))


def test_pointwise_check_is_exact_and_collective_dominates():
    rng = np.random.default_rng(2)
    for trial in range(4):
        member, votes = tiny(rng, 2 + trial % 2)
        C = 2 + trial % 2
        for threat in (hb.Threat(2, patterns=hb.poison_patterns(member)), hb.Threat(1, rounds=[[0, 1, 2, 3], [4, 5, 6, 7]])):
            single = hb.pointwise_flippable(votes, C, threat)
            brute = [hb.brute_force_max_flips(votes, C, threat, points=[t]) == 1 for t in range(votes.shape[1])]
            assert single.tolist() == brute
            res = hb.certify_bagging(votes, C, threat)
            assert res["collective"] >= res["pointwise"]
            assert res["collective"] == votes.shape[1] - hb.brute_force_max_flips(votes, C, threat)


def test_hash_bagging_bounds_the_influence_scope():
    rng = np.random.default_rng(3)
    x = rng.random((500, 10))
    subsets, rounds = hb.hash_bagging_subsets(x, 25, 0.1, salt=1)
    assert len(subsets) == 25 and [len(r) for r in rounds] == [10, 10, 5]
    member = hb.membership(subsets, 500)
    assert hb.influence_scope(member) == math.ceil(25 * 0.1)
    for grp in rounds[:2]:  # full rounds partition the data
        assert (member[:, grp].sum(axis=1) == 1).all()
    vanilla = hb.membership(hb.vanilla_bagging_subsets(500, 25, 50, rng), 500)
    assert hb.influence_scope(vanilla) > 3


def test_poison_patterns_are_distinct_and_maximal():
    member = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=bool)
    assert sorted(map(tuple, hb.poison_patterns(member).astype(int))) == [(0, 0, 1), (1, 1, 0)]


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="portion"):
        hb.hash_bagging_subsets(np.zeros((4, 2)), 3, 0.3)
    with pytest.raises(ValueError, match="exactly one"):
        hb.Threat(1)
    with pytest.raises(ValueError, match="budget"):
        hb.Threat(-1, rounds=[[0]])
