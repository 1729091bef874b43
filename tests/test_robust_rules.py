"""Robust aggregation rules against textbook references, invariances and error paths."""
import math

import numpy as np
import pytest
import torch
from scipy import optimize, stats

from fedlab_nb.methods.robustness.rules import (RULES, _krum_scores, _squared_distances, bulyan, centered_clip,
                                    coordinate_median, drop_nonfinite, flag_aggregator, fltrust, gas,
                                    geometric_median, get_rule, krum, mean, multi_krum, trimmed_mean)


def random_updates(n, d, seed=0, ties=False):
    """float64 updates; ``ties=True`` gives small integers (many equal coordinates) + duplicate rows."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-3, 4, (n, d), generator=g).double()
        x[1] = x[0]
        x[n - 1] = x[2]
        return x
    return torch.randn(n, d, generator=g, dtype=torch.float64)


def with_outliers(n=20, d=10, f=4, value=1e6, seed=0):
    x = random_updates(n, d, seed)
    x[:f] = value
    return x


# ----------------------------------------------------------------------------------------------------
# Loop references, written the way the papers state them


def krum_scores_ref(x, f):
    n = len(x)
    k = max(1, n - f - 2)
    scores = []
    for i in range(n):
        dists = sorted(float(((x[i] - x[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(dists[:k]))
    return np.array(scores)


def multi_krum_ref(x, f, m):
    order = np.argsort(krum_scores_ref(x, f), kind="stable")[:m]
    return x[order].mean(0)


def bulyan_ref(x, f):
    n, d = x.shape
    remaining, selected = list(range(n)), []
    for _ in range(n - 2 * f):
        scores = krum_scores_ref(x[remaining], f) if len(remaining) > 1 else np.zeros(1)
        selected.append(remaining.pop(int(np.argmin(scores))))
    sel = x[selected].numpy()
    beta = n - 4 * f
    out = np.empty(d)
    for j in range(d):
        med = np.median(sel[:, j])
        order = np.lexsort((sel[:, j], np.abs(sel[:, j] - med)))[:beta]  # by distance, then smaller value
        out[j] = sel[order, j].mean()
    return out


# ----------------------------------------------------------------------------------------------------
# Order statistics


@pytest.mark.parametrize("n", [7, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_coordinate_median_matches_numpy(n, ties):
    x = random_updates(n, 13, seed=n, ties=ties)
    x[0, :3] = 1e6
    np.testing.assert_allclose(coordinate_median(x).numpy(), np.median(x.numpy(), axis=0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.34, 0.49])
@pytest.mark.parametrize("ties", [False, True])
def test_trimmed_mean_matches_scipy(beta, ties):
    x = random_updates(11, 9, seed=3, ties=ties)
    x[4] = -1e6
    expected = stats.trim_mean(x.numpy(), beta, axis=0)
    np.testing.assert_allclose(trimmed_mean(x, beta=beta).numpy(), expected, rtol=1e-12, atol=1e-9)


def test_mean_is_weighted_average():
    x = random_updates(6, 4)
    w = torch.tensor([1.0, 2, 0, 5, 1, 3], dtype=torch.float64)
    np.testing.assert_allclose(mean(x, w).numpy(), np.average(x.numpy(), axis=0, weights=w.numpy()), atol=1e-12)
    np.testing.assert_allclose(mean(x).numpy(), x.numpy().mean(0), atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Krum, multi-Krum, Bulyan


@pytest.mark.parametrize("n,f", [(5, 1), (9, 2), (12, 3), (20, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_krum_matches_loop(n, f, ties):
    x = random_updates(n, 6, seed=n + f, ties=ties)
    x[-f:] += 50.0
    expected = x[int(np.argmin(krum_scores_ref(x, f)))]
    torch.testing.assert_close(krum(x, f=f), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n,f,m", [(9, 2, 1), (9, 2, 4), (12, 3, None), (20, 4, 16)])
@pytest.mark.parametrize("ties", [False, True])
def test_multi_krum_matches_loop(n, f, m, ties):
    x = random_updates(n, 6, seed=2 * n, ties=ties)
    x[:f] = -30.0
    expected = multi_krum_ref(x, f, n - f if m is None else m)
    np.testing.assert_allclose(multi_krum(x, f=f, m=m).numpy(), expected, atol=1e-12)


def test_krum_distances_survive_huge_outliers_in_float32():
    x = random_updates(30, 200, seed=8)
    x[:6] = 1e6
    expected = krum_scores_ref(x, 6)[6:]  # float64 loop reference on the honest rows
    ours = _krum_scores(_squared_distances(x.float()), 6)[6:].double().numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-4)


def test_multi_krum_with_m_one_is_krum_and_weights_average_the_chosen():
    x = random_updates(10, 5, seed=4)
    torch.testing.assert_close(multi_krum(x, f=2, m=1), krum(x, f=2))
    order = np.argsort(krum_scores_ref(x, 2), kind="stable")[:5]
    w = torch.arange(1.0, 11.0, dtype=torch.float64)
    expected = np.average(x[order].numpy(), axis=0, weights=w[order].numpy())
    np.testing.assert_allclose(multi_krum(x, w, f=2, m=5).numpy(), expected, atol=1e-12)


@pytest.mark.parametrize("n,f", [(3, 0), (7, 1), (11, 2), (20, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_bulyan_matches_loop(n, f, ties):
    x = random_updates(n, 7, seed=5 * n, ties=ties)
    if f:
        x[:f] = 1e3
    np.testing.assert_allclose(bulyan(x, f=f).numpy(), bulyan_ref(x, f), atol=1e-10)


def test_bulyan_with_f_zero_is_the_mean():
    x = random_updates(6, 5)
    np.testing.assert_allclose(bulyan(x, f=0).numpy(), x.numpy().mean(0), atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Geometric median (RFA)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_geometric_median_minimises_weighted_distance_sum(weighted, seed):
    x = random_updates(15, 5, seed=seed)
    x[:3] = 40.0  # outliers pull the mean, not the median
    w = torch.linspace(1.0, 3.0, 15, dtype=torch.float64) if weighted else None
    wn = np.ones(15) if w is None else w.numpy()
    xn = x.numpy()

    def objective(z):
        return float((wn * np.linalg.norm(xn - z, axis=1)).sum())

    ref = optimize.minimize(objective, xn.mean(0), method="Nelder-Mead",
                            options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000, "maxfev": 40000})
    ours = geometric_median(x, w, tol=1e-10, max_iters=1000).numpy()
    # Weiszfeld stops once the relative objective gain is below tol: it may not be worse than the reference
    assert objective(ours) <= ref.fun * (1 + 1e-8)
    np.testing.assert_allclose(ours, ref.x, atol=1e-3)


def test_geometric_median_of_collinear_points_is_the_median_point():
    x = torch.tensor([[0.0], [1.0], [2.0], [10.0], [100.0]], dtype=torch.float64)
    assert abs(float(geometric_median(x, max_iters=2000, tol=0)) - 2.0) < 1e-4


# ----------------------------------------------------------------------------------------------------
# Centered clipping


def clip_residual(x, v, tau, p):
    diff = x - v
    scale = (tau / diff.norm(dim=1)).clamp(max=1.0)
    return (p * scale) @ diff


def test_centered_clip_with_large_tau_is_the_weighted_mean_in_one_step():
    x = random_updates(8, 6)
    w = torch.arange(1.0, 9.0, dtype=torch.float64)
    out = centered_clip(x, w, center=torch.full((6,), 3.0, dtype=torch.float64), tau=1e9, iters=1)
    np.testing.assert_allclose(out.numpy(), np.average(x.numpy(), axis=0, weights=w.numpy()), atol=1e-10)


def test_centered_clip_converges_to_a_fixed_point_of_the_clipped_step():
    x = with_outliers(n=20, d=10, f=4, value=50.0)
    v = centered_clip(x, center=torch.zeros(10, dtype=torch.float64), tau=0.5, iters=500)
    p = torch.full((20,), 1 / 20, dtype=torch.float64)
    assert clip_residual(x, v, 0.5, p).norm() < 1e-8
    # the fixed point ignores the outliers' magnitude: it stays near the honest cluster
    assert (v - x[4:].mean(0)).norm() < 2.0


def test_centered_clip_moves_at_most_iters_times_tau_from_the_center():
    x = with_outliers(value=1e6)
    center = torch.ones(10, dtype=torch.float64)
    out = centered_clip(x, center=center, tau=0.3, iters=3)
    assert (out - center).norm() <= 3 * 0.3 + 1e-12


def test_centered_clip_default_center_is_the_coordinate_median():
    x = random_updates(9, 4)
    out = centered_clip(x, tau=0.1, iters=1)
    med = coordinate_median(x)
    expected = med + clip_residual(x, med, 0.1, torch.full((9,), 1 / 9, dtype=torch.float64))
    torch.testing.assert_close(out, expected)


# ----------------------------------------------------------------------------------------------------
# GAS


def test_gas_with_one_group_keeps_the_clients_closest_to_the_base_rule():
    x = with_outliers(n=12, d=8, f=3, value=7.0)
    base = coordinate_median(x)
    keep = torch.argsort((x - base).norm(dim=1), stable=True)[:12 - 3]
    torch.testing.assert_close(gas(x, base_rule="median", p=1, f=3), x[keep].mean(0))


def test_gas_contiguous_groups_match_a_loop_over_blocks():
    x = random_updates(10, 13, seed=7)
    x[:2] *= 5
    scores = torch.zeros(10, dtype=torch.float64)
    for block in torch.tensor_split(torch.arange(13), 4):
        part = x[:, block]
        scores += (part - krum(part, f=2)).norm(dim=1)
    keep = torch.argsort(scores, stable=True)[:8]
    out = gas(x, base_rule="krum", p=4, f=2, split="contiguous")
    torch.testing.assert_close(out, x[keep].mean(0))


def test_gas_score_sums_plain_block_distances():
    # A is 3 away in one block (score 3, squared 9); B is 2 away in both blocks (score 4, squared 8)
    a, b = [3.0, 0, 0, 0], [2.0, 0, 2, 0]
    x = torch.tensor([[0.0] * 4, [0.0] * 4, [0.0] * 4, a, b], dtype=torch.float64)
    out = gas(x, base_rule="median", p=2, f=1, split="contiguous")
    torch.testing.assert_close(out, torch.tensor([0.75, 0, 0, 0], dtype=torch.float64))


def test_gas_random_split_is_reproducible_and_averages_n_minus_f_clients():
    x = with_outliers(n=10, d=30, f=2, value=1e3)
    a = gas(x, base_rule="trimmed_mean", base_hyper={"beta": 0.2}, p=5, f=2,
            generator=torch.Generator().manual_seed(1))
    b = gas(x, base_rule=trimmed_mean, base_hyper={"beta": 0.2}, p=5, f=2,
            generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, x[2:].mean(0))  # the outliers are the ones dropped


# ----------------------------------------------------------------------------------------------------
# FLTrust


def test_fltrust_hand_computed():
    g0 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    x = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    # trust = [1, 0, 0, 1/√2]; rescaled rows to ‖g0‖ = 1: [1, 0] and [1/√2, 1/√2]
    s = 1 / math.sqrt(2)
    expected = (torch.tensor([1.0, 0.0]) + s * torch.tensor([s, s])) / (1 + s)
    torch.testing.assert_close(fltrust(x, server_update=g0), expected.double())
    torch.testing.assert_close(fltrust(x, server_update=3 * g0), 3 * expected.double())


def test_fltrust_returns_zeros_when_no_client_is_trusted():
    x = torch.tensor([[-1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    assert torch.equal(fltrust(x, server_update=torch.tensor([1.0, 0.0], dtype=torch.float64)),
                       torch.zeros(2, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# FlagAggregator


def flag_ref(x, r, lam, iters, eps=1e-7):
    """FlagIRLS written directly on the d×m column matrix with numpy's SVD (the repo's formulation)."""
    xh = x.numpy() / np.linalg.norm(x.numpy(), axis=1, keepdims=True)
    n = len(xh)

    def top(columns):
        return np.linalg.svd(np.stack(columns, axis=1), full_matrices=False)[0][:, :r]

    def objective(y):
        return np.sqrt(np.clip(1 - ((xh @ y) ** 2).sum(1), 0, None)).sum()

    y = top(list(xh))
    for _ in range(iters):
        cols = [(abs(1 - ((y.T @ xi) ** 2).sum()) + eps) ** -0.25 * xi for xi in xh]
        if lam > 0:
            for i in range(n):
                for j in range(n):
                    if i != j:
                        dij = xh[i] - xh[j]
                        w = (abs(1 - ((y.T @ dij) ** 2).sum()) + eps) ** -0.25 * lam / (n * (n - 1))
                        cols.append(w * dij)
        y_new = top(cols)
        if objective(y_new) >= objective(y):
            break
        y = y_new
    return (y @ (y.T @ xh.T)).sum(1) / r


@pytest.mark.parametrize("r,lam,iters", [(1, 0.0, 0), (1, 0.0, 3), (2, 0.0, 3), (1, 1.0, 3), (3, 0.5, 2)])
def test_flag_matches_a_direct_svd_implementation(r, lam, iters):
    x = with_outliers(n=9, d=30, f=2, value=3.0) + 0.5
    ours = flag_aggregator(x, r=r, lam=lam, iters=iters)
    np.testing.assert_allclose(ours.numpy(), flag_ref(x, r, lam, iters), atol=1e-8)


def test_flag_identical_inputs_give_that_direction():
    v = torch.tensor([3.0, -4.0, 12.0], dtype=torch.float64)
    x = v.repeat(5, 1)
    # the paper's output Σ_i Y Yᵀ x̂_i / r = n · v/‖v‖ for identical inputs
    torch.testing.assert_close(flag_aggregator(x), 5 * v / v.norm())
    torch.testing.assert_close(flag_aggregator(x, rescale=True), v)


def test_flag_ignores_one_far_outlier_better_than_mean():
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(50, generator=g, dtype=torch.float64)
    x = direction + 0.3 * torch.randn(15, 50, generator=g, dtype=torch.float64)
    x[0] = 1e6 * torch.randn(50, generator=g, dtype=torch.float64)
    honest = x[1:].mean(0)

    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    out = flag_aggregator(x, r=1, iters=5)
    assert cos(out, honest) > 0.95 > cos(mean(x), honest)
    assert flag_aggregator(x, rescale=True).norm() < 2 * x[1:].norm(dim=1).max()


def test_flag_irls_does_not_increase_the_objective():
    x = with_outliers(n=15, d=20, f=3, value=5.0)
    xhat = x / x.norm(dim=1, keepdim=True)

    def objective(out):  # r = 1: Y = out/‖out‖
        y = out / out.norm()
        return float((1 - (xhat @ y) ** 2).clamp_min(0).sqrt().sum())

    objs = [objective(flag_aggregator(x, iters=k)) for k in (0, 1, 3, 10)]
    assert all(b <= a + 1e-12 for a, b in zip(objs, objs[1:]))


def test_flag_with_pairwise_term_runs_and_r_two():
    x = random_updates(8, 12)
    for kw in ({"lam": 1.0}, {"r": 2}, {"r": 3, "lam": 0.5}):
        assert torch.isfinite(flag_aggregator(x, **kw)).all()


# ----------------------------------------------------------------------------------------------------
# Invariances over every rule

ALL = {
    "mean": {},
    "coordinate_median": {},
    "trimmed_mean": {"beta": 0.25},
    "krum": {"f": 4},
    "multi_krum": {"f": 4},
    "bulyan": {"f": 4},
    "geometric_median": {},
    "centered_clip": {"tau": 1.0, "iters": 3},
    "flag_aggregator": {"rescale": True},
    "gas": {"base_rule": "coordinate_median", "p": 4, "f": 4},
    "fltrust": {},
}


@pytest.mark.parametrize("name", ALL)
def test_rule_is_permutation_invariant(name):
    x = random_updates(20, 16, seed=11)
    hyper = dict(ALL[name])
    if name == "fltrust":
        hyper["server_update"] = x.mean(0)
    if name == "gas":
        a = gas(x, generator=torch.Generator().manual_seed(0), **hyper)
        b = gas(x.flip(0), generator=torch.Generator().manual_seed(0), **hyper)
    else:
        a, b = RULES[name](x, **hyper), RULES[name](x[torch.randperm(20)], **hyper)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identical_updates_give_that_update(name, dtype):
    v = torch.linspace(-2, 3, 9, dtype=dtype)
    x = v.repeat(20, 1)
    hyper = dict(ALL[name], **({"server_update": v} if name == "fltrust" else {}))
    out = RULES[name](x, **hyper)
    assert out.dtype == dtype and out.shape == (9,)
    torch.testing.assert_close(out, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ALL)
def test_rules_run_on_cuda_and_match_cpu(name):
    x = random_updates(20, 64, seed=12)
    hyper = dict(ALL[name], **({"server_update": x.mean(0)} if name == "fltrust" else {}))
    if name == "gas":
        hyper["split"] = "contiguous"
    hyper_cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in hyper.items()}
    out = RULES[name](x.cuda(), **hyper_cuda)
    assert out.device.type == "cuda" and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu(), RULES[name](x, **hyper), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", [k for k in ALL if k != "mean"])
def test_robust_rules_stay_bounded_under_outliers_while_mean_explodes(name):
    x = with_outliers(n=20, d=10, f=4, value=1e6).float()
    honest_scale = float(x[4:].norm(dim=1).max())
    hyper = dict(ALL[name], **({"server_update": x[4:].mean(0)} if name == "fltrust" else {}))
    assert float(RULES[name](x, **hyper).norm()) < 3 * honest_scale
    assert float(mean(x).norm()) > 1e5


# ----------------------------------------------------------------------------------------------------
# Registry, non-finite rows, error paths


def test_get_rule_binds_hyperparameters_and_suggests_names():
    x = random_updates(9, 3)
    torch.testing.assert_close(get_rule("krum", f=2)(x), krum(x, f=2))
    with pytest.raises(ValueError, match="krum"):
        get_rule("krun")
    with pytest.raises(ValueError, match="no hyperparameter"):
        get_rule("median", beta=0.1)


def test_nonfinite_rows_are_named_or_dropped():
    x = random_updates(9, 3)
    x[2, 1] = float("nan")
    x[5, 0] = float("inf")
    for name in ALL:
        hyper = dict(ALL[name], **({"server_update": torch.ones(3, dtype=torch.float64)} if name == "fltrust" else {}))
        hyper.update({"f": 1} if "f" in hyper else {})
        with pytest.raises(ValueError, match=r"rows \[2, 5\]"):
            RULES[name](x, **hyper)
    kept_x, kept_w, mask = drop_nonfinite(x, torch.ones(9))
    assert mask.tolist() == [True, True, False, True, True, False, True, True, True] and len(kept_w) == 7
    torch.testing.assert_close(get_rule("trimmed_mean", beta=0.2, drop_nonfinite=True)(x),
                               trimmed_mean(kept_x, beta=0.2))
    big = torch.ones(3, 4)
    big[1] = 3e38  # finite entries whose row sum overflows are not mistaken for non-finite rows
    assert drop_nonfinite(big)[2].all()
    with pytest.raises(ValueError, match="every client"):
        drop_nonfinite(torch.full((2, 2), float("nan")))


@pytest.mark.parametrize("call,match", [
    (lambda x: krum(x[:6], f=2), r"n > 2f \+ 2.*n=6.*f=2"),
    (lambda x: multi_krum(x, f=5), r"n > 2f \+ 2"),
    (lambda x: multi_krum(x, f=1, m=11), "1 <= m <= n"),
    (lambda x: bulyan(x, f=2), r"n >= 4f \+ 3.*n=10.*f=2"),
    (lambda x: krum(x, f=-1), "non-negative int"),
    (lambda x: trimmed_mean(x, beta=0.5), "0 <= beta < 0.5"),
    (lambda x: trimmed_mean(x, beta=-0.1), "0 <= beta < 0.5"),
    (lambda x: gas(x, p=0), "p >= 1"),
    (lambda x: gas(x, f=5), "f < n/2"),
    (lambda x: gas(x, base_rule="nope"), "base_rule"),
    (lambda x: gas(x, split="spiral"), "split"),
    (lambda x: geometric_median(x, nu=0), "nu > 0"),
    (lambda x: centered_clip(x, tau=0), "tau > 0"),
    (lambda x: centered_clip(x, center=torch.zeros(2)), "center must be"),
    (lambda x: fltrust(x), "server_update"),
    (lambda x: fltrust(x, server_update=torch.zeros(2)), "server_update must be"),
    (lambda x: flag_aggregator(x, r=0), "r >= 1"),
    (lambda x: mean(x, torch.ones(3)), "weights must have shape"),
    (lambda x: mean(x, -torch.ones(10)), "non-negative"),
    (lambda x: mean(x[0]), r"shape \[n, d\]"),
])
def test_error_paths_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call(random_updates(10, 4))


def test_integer_updates_are_a_type_error():
    with pytest.raises(TypeError, match="floating-point"):
        mean(torch.ones(3, 2, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------------
# Cross-check with Flower's own aggregate functions (only when flwr is installed)


@pytest.mark.parametrize("n,f", [(11, 2), (12, 2), (20, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_flower_aggregate_functions(n, f, seed):
    agg = pytest.importorskip("flwr.server.strategy.aggregate")
    x = random_updates(n, 6, seed=seed)
    x[:f] += 20
    results = [([row.numpy()], 1) for row in x]
    np.testing.assert_allclose(agg.aggregate_median(results)[0], coordinate_median(x).numpy(), atol=1e-12)
    np.testing.assert_allclose(agg.aggregate_trimmed_avg(results, 0.2)[0], trimmed_mean(x, beta=0.2).numpy(),
                               atol=1e-12)
    np.testing.assert_allclose(agg.aggregate_krum(results, f, 0)[0], krum(x, f=f).numpy(), atol=1e-12)
    np.testing.assert_allclose(agg.aggregate_krum(results, f, 5)[0], multi_krum(x, f=f, m=5).numpy(), atol=1e-12)
    flower_bulyan = agg.aggregate_bulyan(list(results), f, agg.aggregate_krum, to_keep=0)  # pops its input
    np.testing.assert_allclose(flower_bulyan[0], bulyan(x, f=f).numpy(), atol=1e-12)
