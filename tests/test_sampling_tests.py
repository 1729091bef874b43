"""The DP rule's randomness tests (methods/privacy/sampling_tests.py): each probability is exact under a fair
sampler, schedules and grouped draws are refused, fair samplers are not."""
import numpy as np
import pytest
import torch

from fedlab_nb.methods.privacy import sampling_tests
from fedlab_nb.methods.privacy.dp import DPAggregate
from probes import sampling_check_run as run


@pytest.mark.parametrize("n,q,w", [(50, 0.1, 1.0), (100, 0.3, 2.5), (64, 0.05, 0.7)])
def test_stays_within_equals_a_simulation(n, q, w):
    counts = (np.random.default_rng(0).random((100_000, n)) < q).cumsum(1)
    inside = (np.abs(counts - q * np.arange(1, n + 1)) <= w + 1e-9).all(1).mean()
    p = sampling_tests.stays_within(n, q, w)
    assert abs(p - inside) < 5 * np.sqrt(p * (1 - p) / 100_000)


def test_stays_within_a_band_nobody_can_keep_is_zero():
    assert sampling_tests.stays_within(20, 0.5, 0.2) == 0.0   # c(1) ∈ {0, 1} is 0.5 from q·1


def _cycle(m):  # each client once per pass, passes shuffled: "sampling without replacement" across rounds
    queue = []

    def pick(r, K, g):
        if len(queue) < m:
            queue.extend(g.permutation(K))
        out = queue[:m]
        del queue[:m]
        return np.array(out)
    return pick


@pytest.mark.parametrize("K,m,within", [(100, 1, 200), (50, 5, 20), (10, 3, 200), (10, 1, 400)])
def test_a_shuffled_cycle_declared_fixed_is_refused(K, m, within):  # many clients: in two passes (too even)
    refused = run(K, m / K, "fixed", _cycle(m), 3000)
    assert refused is not None and refused <= within


def test_a_cycle_declared_poisson_is_refused():
    assert run(20, 0.1, "poisson", _cycle(2), 2000) is not None


def test_a_round_robin_of_one_client_a_round_is_refused_with_its_reason():
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.1, sampling="fixed")
    state = rule.init_state(torch.zeros(3), 10)
    with pytest.raises(ValueError, match=r"not random: client \d+'s count stayed within .* dp_sampler"):
        for r in range(3000):
            rule._check_sampling(state, 1, np.array([r % 10]))


def test_groups_of_three_under_fixed_sampling_are_refused_naming_two_of_them():
    groups = lambda r, K, g: np.sort(np.concatenate([3 * i + np.arange(3) for i in g.choice(K // 3, 2, False)]))  # noqa
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.2, sampling="fixed")
    state, g = rule.init_state(torch.zeros(3), 30), np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"clients (\d+) and (\d+) were aggregated together in \d+ of \d+ rounds"):
        for r in range(3000):
            rule._check_sampling(state, 6, groups(r, 30, g))


def test_pairs_among_many_clients_are_met_by_the_subset():
    pairs = lambda r, K, g: np.flatnonzero(np.repeat(g.random(K // 2) < 0.05, 2))  # noqa: E731
    assert run(2000, 0.05, "poisson", pairs, 400) is not None


@pytest.mark.parametrize("K,q,sampling", [(10, 0.1, "fixed"), (4, 0.5, "fixed"), (2, 0.5, "poisson"),
                                          (50, 0.02, "poisson"), (20, 0.9, "poisson"), (600, 0.05, "fixed")])
@pytest.mark.parametrize("seed", range(5))
def test_fair_samplers_are_never_refused(K, q, sampling, seed):
    m = round(q * K)
    pick = ((lambda r, K, g: np.flatnonzero(g.random(K) < q)) if sampling == "poisson"
            else (lambda r, K, g: g.choice(K, m, replace=False)))
    assert run(K, q, sampling, pick, 1000, seed=seed, drawn=True) is None


def test_a_fair_sampler_losing_stragglers_is_not_refused():
    pick = lambda r, K, g: np.flatnonzero((g.random(K) < 0.3) & (g.random(K) < 0.5))  # noqa: E731
    assert run(10, 0.3, "poisson", pick, 2000, drawn=False) is None  # the clients aggregated, not the draw


def test_a_checkpoint_without_the_tests_state_is_refused():  # an older version's: the tests would run blind
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.5, sampling="poisson")
    state = rule.init_state(torch.zeros(3), 4)
    for key in ("seen_tests", "seen_each"):
        with pytest.raises(ValueError, match=f"{key}.*resume=False"):
            rule._check_sampling({k: v for k, v in state.items() if k != key}, 1, np.array([2]))


def test_the_pair_subset_is_fixed_by_the_number_of_clients():
    a, b = sampling_tests.pair_clients(5000), sampling_tests.pair_clients(5000)
    assert torch.equal(a, b) and len(a) == sampling_tests.PAIR_CLIENTS and bool((a[1:] > a[:-1]).all())
    assert torch.equal(sampling_tests.pair_clients(7), torch.arange(7))


@pytest.mark.parametrize("damage", [
    lambda t: t.update(walk_dev=t["walk_dev"][:-1]), lambda t: t.update(pairs=t["pairs"].double()),
    lambda t: t.update(pair_ids=t["pair_ids"].flip(0)), lambda t: t.update(pair_rounds=-1),
    lambda t: t.update(pair_rounds=2.5), lambda t: t.pop("pairs")],
    ids=["short walk", "float pairs", "other pair ids", "negative rounds", "float rounds", "no pairs"])
def test_an_altered_tests_state_is_refused_naming_the_fix(damage):
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.5, sampling="poisson")
    state = rule.init_state(torch.zeros(3), 4)
    damage(state["seen_tests"])
    with pytest.raises(ValueError, match="seen_tests.*resume=False"):
        rule._check_sampling(state, 1, np.array([2]))


@pytest.mark.parametrize("each", [torch.zeros(3, dtype=torch.int64), torch.zeros(4), -torch.ones(4, dtype=torch.int64)])
def test_altered_per_client_counts_are_refused(each):
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.5, sampling="poisson")
    state = {**rule.init_state(torch.zeros(3), 4), "seen_each": each}
    with pytest.raises(ValueError, match="seen_each.*resume=False"):
        rule._check_sampling(state, 1, np.array([2]))


def _kept(q, shift):  # each Poisson sample used for two rounds, from round shift on
    last = {}

    def pick(r, K, g):
        if r < shift or (r - shift) % 2 == 0:
            last["ids"] = np.flatnonzero(g.random(K) < q)
        return last["ids"]
    return pick


@pytest.mark.parametrize("shift", [0, 1])
def test_a_sample_kept_for_a_second_round_is_refused_at_either_alignment(shift):
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.1, sampling="poisson")
    state, g, pick = rule.init_state(torch.zeros(3), 10), np.random.default_rng(0), _kept(0.1, shift)
    with pytest.raises(ValueError, match=r"in both rounds of \d+ of the \d+ round pairs"):
        for r in range(3000):
            ids = pick(r, 10, g)
            rule._check_sampling(state, len(ids), ids)


def _never_together(q):  # clients in pairs (2i, 2i+1): one of the two with probability 2q, never both
    def pick(r, K, g):
        take, which = g.random(K // 2) < 2 * q, g.integers(0, 2, K // 2)
        return 2 * np.flatnonzero(take) + which[take]
    return pick


@pytest.mark.parametrize("K,q,pick,sampling", [
    (10, 0.25, _never_together(0.25), "poisson"),
    (8, 0.25, lambda r, K, g: np.array([2 * g.integers(K // 2), 2 * g.integers(K // 2) + 1]), "fixed"),
    (10, 0.07, lambda r, K, g: np.array([g.integers(K)]) if g.random() < 0.7 else np.array([], int), "poisson")],
    ids=["pairs never together", "one even and one odd client (fixed)", "at most one a round"])
def test_draws_that_keep_clients_apart_or_cap_their_size_are_refused(K, q, pick, sampling):
    assert run(K, q, sampling, pick, 3000, drawn=True) is not None


def _redraw_empty(q):  # "nobody sampled? draw again": never an empty round
    def pick(r, K, g):
        while True:
            ids = np.flatnonzero(g.random(K) < q)
            if len(ids):
                return ids
    return pick


def test_a_sampler_that_redraws_an_empty_round_is_refused():
    assert run(10, 0.1, "poisson", _redraw_empty(0.1), 3000, drawn=True) is not None


def test_fewer_clients_left_after_drops_are_not_judged_as_a_draw():
    at_most_three = lambda r, K, g: np.flatnonzero(g.random(K) < 0.3)[:3]  # noqa: E731 (the rest dropped)
    assert run(10, 0.3, "poisson", at_most_three, 1000, drawn=False) is None
    assert run(10, 0.3, "poisson", at_most_three, 1000, drawn=True) is not None  # as a draw: capped at three


def _cool_down(q, fixed=False):  # a client that took part rests one round; the others drawn more often to keep q
    last = set()

    def pick(r, K, g):
        free = np.array(sorted(set(range(K)) - last))
        ids = np.sort(g.choice(free, round(q * K), replace=False)) if fixed else free[g.random(len(free)) < q / (1 - q)]
        last.clear()
        last.update(ids.tolist())
        return ids
    return pick


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_sampler_that_rests_a_client_after_it_takes_part_is_refused_naming_why(sampling):
    from fedlab_nb.methods.privacy.dp import DPAggregate
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.3, sampling=sampling)
    state, g, pick = rule.init_state(torch.zeros(3), 10), np.random.default_rng(0), _cool_down(0.3, sampling == "fixed")
    with pytest.raises(ValueError, match="rests a client 1 round after it takes part"):
        for r in range(300):
            ids = pick(r, 10, g)
            rule._check_sampling(state, len(ids), ids, drawn=True)
