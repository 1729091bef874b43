"""Run-off election and DPA certificates (fedlab_nb/methods/beyond/run_off_election.py): exact checks against brute force."""
import numpy as np
import pytest

from fedlab_nb.methods.beyond import run_off_election as roe


def paper_dp_table(K):
    """dp_calc.py's recursion written out as the paper states it, branch by branch (independent of the library's)."""
    A = np.zeros((K, K), dtype=int)
    for i in range(K):
        for j in range(K):
            if i == 0 and j == 0:
                A[i, j] = 0
            elif i <= 1 and j <= 2:
                A[i, j] = 1
            elif i <= 2 and j <= 1:
                A[i, j] = 1
            elif j <= 1:
                A[i, j] = (i + 1) // 2
            elif i <= 1:
                A[i, j] = (j + 1) // 2
            else:
                A[i, j] = 1 + min(A[i - 2, j - 1], A[i - 1, j - 2])
    return A


def test_two_gap_cost_matches_the_papers_table():
    g = np.arange(40)
    assert np.array_equal(roe.two_gap_cost(g[:, None], g[None, :]), paper_dp_table(40))
    assert np.array_equal(roe.paper_two_gap_table(40), paper_dp_table(40))


def test_dpa_certificate_by_hand():
    counts = np.array([[5, 3, 2], [3, 5, 0], [4, 4, 0], [4, 0, 4]])
    # [5,3,2]: (5-3)/2 = 1; [3,5,0]: winner 1, rival 0 < 1 -> (5-3-1)//2 = 0; [4,4,0]: winner 0 by the tie -> 0
    assert roe.dpa_certificate(counts).tolist() == [1, 0, 0, 0]
    assert roe.plurality(counts).tolist() == [0, 1, 0, 0]


def test_dpa_certificate_is_tight_against_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(60):
        C, k = int(rng.integers(3, 5)), int(rng.integers(2, 10))
        votes = rng.choice(C, size=k, p=rng.dirichlet(np.ones(C) * 0.7))
        cert = roe.dpa_certificate(roe.vote_counts(votes[None], C))[0]
        flip = roe.brute_force_flip_size(list(votes), lambda o: roe.plurality_of(o, C), list(range(C)))
        assert cert == flip - 1


def test_roe_prediction_and_certificate_against_brute_force():
    rng = np.random.default_rng(2)
    tight = 0
    for _ in range(60):
        C, k = 3, int(rng.integers(3, 7))
        ranks = roe.rankings(rng.normal(0, 1, (1, k, C)) + rng.normal(0, 1, C))
        models = [tuple(int(v) for v in r) for r in ranks[0]]
        assert roe.roe_predict(ranks)[0] == roe.runoff_of(models, C)
        flip = roe.brute_force_flip_size(models, lambda o: roe.runoff_of(o, C), roe.all_rankings(C))
        cert = roe.roe_certificate(ranks)[0]
        assert 0 <= cert <= flip - 1
        tight += cert == flip - 1
    assert tight > 0


def test_runoff_uses_the_second_preferences():
    # 5 models: 2 vote 0, 2 vote 1, 1 votes 2 but prefers 1 over 0 -> round 1 finalists 0, 1; run-off 1 wins 3-2
    models = [(0, 1, 2), (0, 1, 2), (1, 0, 2), (1, 0, 2), (2, 1, 0)]
    ranks = np.array([models])
    assert roe.plurality(roe.vote_counts(ranks[..., 0], 3))[0] == 0
    assert roe.roe_predict(ranks)[0] == 1


def _part_of(parts, n):
    where = np.empty(n, int)
    for j, p in enumerate(parts):
        where[p] = j
    return where


def test_hash_partition_follows_content_not_index():
    rng = np.random.default_rng(3)
    x = rng.random((200, 16))
    parts = roe.hash_partition(x, 7, salt=5)
    assert sorted(np.concatenate(parts).tolist()) == list(range(200))
    perm = rng.permutation(200)
    assert np.array_equal(_part_of(roe.hash_partition(x[perm], 7, salt=5), 200), _part_of(parts, 200)[perm])
    assert not np.array_equal(_part_of(roe.hash_partition(x, 7, salt=6), 200), _part_of(parts, 200))


def test_ensemble_scores_handle_missing_classes():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(30, 5)), np.repeat([0, 1, 2], 10)
    scores = roe.ensemble_scores(x, y, [np.arange(20), np.arange(10)], x, num_classes=4)
    assert scores.shape == (30, 2, 4)
    assert (scores[:, 0, 2:] == -1e9).all() and (scores[:, 1, 0] == 0).all()
    assert (roe.rankings(scores)[:, 1, 0] == 0).all()


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="k"):
        roe.hash_partition(np.zeros((3, 2)), 0)
    with pytest.raises(ValueError, match="scores"):
        roe.dpa_and_roe(np.zeros((3, 2)))
