"""CPDA in Z_p: exact sums, the leader's view under substituted readings, collusion, tampering, message
counts, and the FL rule — against sympy's modular linear algebra and direct formulas."""
import numpy as np
import pytest
import torch

from fedlab_nb.methods.privacy import cpda as C


def _run(m=3, length=None, seed=0, lo=-1000, hi=1000):
    rng = np.random.default_rng(seed)
    shape = (m,) if length is None else (m, length)
    d = rng.integers(lo, hi, size=shape)
    return d, C.run_cluster(C.encode(d), rng)


@pytest.mark.parametrize("m,length", [(3, None), (5, None), (10, 7)])
def test_sum_is_exact(m, length):
    d, run = _run(m, length)
    assert np.array_equal(C.decode(run.total), d.sum(0))


def test_lagrange_weights_match_sympy_solve_and_formula():
    from sympy import Matrix
    rng = np.random.default_rng(1)
    seeds = C.public_seeds(4, rng)
    lam = C.lagrange_weights_at_zero(seeds)
    for j in range(4):   # closed form ℓ_j(0) = Π_{l≠j} x_l / (x_l − x_j)
        num = den = 1
        for l in range(4):
            if l != j:
                num, den = num * int(seeds[l]) % C.P, den * (int(seeds[l]) - int(seeds[j])) % C.P
        assert lam[j] == num * C.inverse(den) % C.P
        assert C.lagrange_basis_coeffs(seeds, j)[0] == lam[j]
    # the full Vandermonde solve recovers (D, R_1, R_2, R_3) of the assembled polynomial
    d, run = _run(4, seed=2)
    sol = Matrix(C.vandermonde(run.seeds)).inv_mod(C.P) * Matrix([int(f) for f in run.assembled])
    coeffs = [int(v) % C.P for v in sol]
    assert coeffs[0] == int(run.total)
    assert coeffs[1:] == [int(v) for v in np.mod(run.coeffs[:, 1:].sum(0), C.P)]


def test_share_formula_m3():
    d, run = _run(3, seed=3)
    for i in range(3):
        for j, x in enumerate(run.seeds):
            x = int(x)
            want = (int(run.readings[i]) + int(run.coeffs[i, 1]) * x + int(run.coeffs[i, 2]) * x * x) % C.P
            assert run.shares[i, j] == want


def test_leader_view_is_the_same_for_other_readings_with_the_same_sum():
    d, run = _run(4, seed=4)
    new = d.copy()
    new[1] += 123456
    new[3] -= 123456
    alt = C.run_cluster(C.encode(new), seeds=run.seeds, leader=run.leader,
                        coeffs=C.equivalent_randomness(run, C.encode(new)))
    v, w = C.leader_view(run), C.leader_view(alt)
    assert all(np.array_equal(v[k], w[k]) for k in v)
    assert not np.array_equal(alt.readings, run.readings)
    with pytest.raises(ValueError, match="same sum"):
        C.equivalent_randomness(run, C.encode(d + np.array([0, 1, 0, 0])))


def test_colluders_recover_the_last_reading():
    d, run = _run(5, seed=5)
    assert C.colluders_recover(run, 3) == d[3]


def test_tampering_shifts_sum_and_is_explained_by_an_honest_run():
    d, run = _run(4, seed=6)
    lam = C.lagrange_weights_at_zero(run.seeds)
    plain = C.tamper(run, 2, 1)
    assert C.decode(plain.total - run.total) == C.decode(lam[2])          # +1 on F_j moves D by λ_j
    c = C.shift_for_sum_change(run.seeds, 2, 777)
    bad = C.tamper(run, 2, c)
    assert C.decode(bad.total) == d.sum() + 777
    honest = C.honest_explanation_of_tamper(run, 2, c)
    v, w = C.leader_view(bad), C.leader_view(honest)
    assert all(np.array_equal(v[k], w[k]) for k in v)
    assert C.decode(honest.readings[2]) == d[2] + 777


def test_message_counts():
    _, run = _run(4, length=5)
    assert [(x.sender, x.receiver, x.kind) for x in run.messages] == \
        [(x.sender, x.receiver, x.kind) for x in C.cpda_messages(4, 5)]
    assert {(x.sender, x.receiver) for x in run.messages if x.kind == "share"} == \
        {(i, j) for i in range(4) for j in range(4) if i != j}
    for m in (3, 10):
        cp = C.traffic(C.cpda_messages(m, length=100))
        assert cp["messages"] == m * m - 1 and cp["bytes"] == (m * m - 1) * 100 * C.FIELD_BYTES
        bw = C.pairwise_masking_messages(m, length=100)
        assert len(bw) == 7 * m
        assert sum(x.payload_bytes for x in bw if x.kind == "masked_input") == m * 100 * C.FIELD_BYTES


def test_rule_equals_quantised_sum():
    rng = np.random.default_rng(0)
    updates = torch.tensor(rng.standard_normal((6, 50)) * 0.1, dtype=torch.float32)
    weights = torch.tensor(rng.integers(10, 100, 6), dtype=torch.float32)
    rule = C.CPDARule(frac_bits=16, seed=0)
    agg, st = rule.aggregate(rule.init_state(torch.zeros(50), 6), updates, weights)
    assert st["int_diff"] == 0.0
    mean = (weights / weights.sum()) @ updates
    assert (agg - mean).abs().max() <= 6 * 2.0 ** -17 + 1e-6


def test_clear_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="m >= 3"):
        C.run_cluster(C.encode([1, 2]), rng)
    with pytest.raises(ValueError, match="distinct and non-zero"):
        C.run_cluster(C.encode([1, 2, 3]), rng, seeds=[5, 5, 7])
    with pytest.raises(ValueError, match="must be integers"):
        C.run_cluster(np.array([0.5, 1.0, 2.0]), rng)
    with pytest.raises(ValueError, match="frac_bits"):
        C.quantise([1.0], frac_bits=40)
    _, run = _run(3)
    with pytest.raises(ValueError, match="must not be the leader"):
        C.tamper(run, run.leader, 1)
