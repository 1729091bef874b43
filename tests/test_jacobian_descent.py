"""UPGrad and Jacobian descent (fedlab_nb/methods/beyond/jacobian_descent.py) against TorchJD 0.18 (the reference
implementation of Quinton & Rey, arXiv 2406.16232) and against the paper's exact properties."""
import importlib.util
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import lsq_linear

from fedlab_nb.methods.beyond import jacobian_descent as JD
from fedlab_nb.models import flatten_params, make_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchjd_aggregation = pytest.importorskip("torchjd.aggregation")
    from torchjd._linalg import DualConeProjector, normalize, regularize

HAS_QUADPROG = all(importlib.util.find_spec(m) is not None for m in ("qpsolvers", "quadprog"))


class BoundedLsqProjector(DualConeProjector):
    """TorchJD's QP (min vᵀGv s.t. v ≥ u, G normalised and regularised as its default projector does) solved
    by SciPy's bounded-variable least squares — a solver independent of the library's NNLS — for when
    TorchJD's own quadprog backend is not installed."""

    def __call__(self, U, G):
        G = regularize(normalize(G, 1e-4), 1e-4).double().numpy()
        L = np.linalg.cholesky(G)  # vᵀGv = ‖Lᵀv‖²
        W = [lsq_linear(L.T, np.zeros(len(G)), bounds=(u, np.inf), method="bvls", tol=1e-15).x for u in U.double().numpy()]
        return torch.tensor(np.array(W), dtype=U.dtype)


def _random_jacobians(n, seed=0, m_max=10, d_max=20):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        m, d = int(torch.randint(2, m_max, (1,), generator=g)), int(torch.randint(2, d_max, (1,), generator=g))
        yield torch.randn(m, d, generator=g, dtype=torch.float64)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_matches_torchjd_upgrad_with_an_independent_qp_solver():
    reference = torchjd_aggregation.UPGrad(projector=BoundedLsqProjector())
    for J in _random_jacobians(40):
        assert _rel(JD.upgrad(J, norm_eps=1e-4, reg_eps=1e-4), reference(J)) < 1e-8


@pytest.mark.skipif(not HAS_QUADPROG, reason="torchjd's default projector needs qpsolvers + quadprog (torchjd[quadprog_projector])")
def test_matches_torchjd_upgrad_default():
    reference = torchjd_aggregation.UPGrad()
    for J in _random_jacobians(40, seed=1):
        assert _rel(JD.upgrad(J, norm_eps=1e-4, reg_eps=1e-4), reference(J)) < 1e-6


def test_torchjd_docstring_example():
    J = torch.tensor([[-4.0, 1, 1], [6, 1, 1]], dtype=torch.float64)
    np.testing.assert_allclose(JD.upgrad(J, norm_eps=1e-4, reg_eps=1e-4).numpy(), [0.2929, 1.9004, 1.9004], atol=1e-4)
    np.testing.assert_allclose(JD.upgrad(J).numpy(), [0.2924, 1.9006, 1.9006], atol=1e-4)  # the exact (unregularised) value


def test_non_conflicting_linear_under_scaling_and_weighted():
    g = torch.Generator().manual_seed(3)
    for J in _random_jacobians(30, seed=2):
        m = len(J)
        a = JD.upgrad(J)
        assert JD.conflict(J, a) >= -1e-10 * float(J.norm()) ** 2
        assert float(JD.upgrad_weights(J).min()) >= 1 / m - 1e-12
        c = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
        linear = (c[:, None] * JD.project_rows(J)).mean(0)
        assert float((JD.upgrad(c[:, None] * J) - linear).norm()) < 1e-10 * float(J.norm())
        P = JD.project_rows(J)  # each projection is in the dual cone and no farther from g_i than 0 is
        assert float((J @ P.T).min()) >= -1e-10 * float(J.norm()) ** 2
        assert ((P - J).norm(dim=1) <= J.norm(dim=1) + 1e-10).all()


def test_projection_is_identity_inside_the_cone():
    J = torch.tensor([[1.0, 0.2, 0.0], [0.3, 1.0, 0.1], [0.1, 0.1, 1.0]], dtype=torch.float64)  # no conflicts
    assert float((J @ J.T).min()) > 0
    torch.testing.assert_close(JD.project_rows(J), J, atol=1e-12, rtol=0)
    torch.testing.assert_close(JD.upgrad(J), JD.mean_aggregate(J), atol=1e-12, rtol=0)


def test_counterexamples_mean_and_mgda():
    J = torch.tensor([[1.0, 0.0], [-3.0, 0.1]], dtype=torch.float64)
    assert JD.conflict(J, JD.mean_aggregate(J)) == pytest.approx(-1.0)
    assert JD.conflict(J, JD.upgrad(J)) >= 0
    J = torch.randn(3, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # m < d: min norm ≠ 0
    c1, c2 = torch.full((len(J),), 1.0, dtype=torch.float64), torch.linspace(0.2, 3.0, len(J), dtype=torch.float64)
    f = lambda c: JD.min_norm(c[:, None] * J)
    g = lambda c: JD.upgrad(c[:, None] * J)
    assert float((f(c1 + c2) - f(c1) - f(c2)).norm()) > 1e-3 * float(J.norm())
    assert float((g(c1 + c2) - g(c1) - g(c2)).norm()) < 1e-10 * float(J.norm())


def test_min_norm_against_torchjd_mgda():
    mgda = torchjd_aggregation.MGDA(epsilon=1e-7, max_iters=3000)  # Frank-Wolfe (Sener & Koltun's Algorithm 2)
    for J in _random_jacobians(5, seed=6):
        ours, theirs = JD.min_norm(J), mgda(J)
        assert float(ours.norm()) <= float(theirs.norm()) + 1e-6  # ours is the exact minimum norm
        assert float((ours - theirs).norm()) < 1e-2 * float(J.norm())


def test_byzantine_minus_multiple_of_the_mean_vetoes():
    g = torch.Generator().manual_seed(7)
    honest = torch.randn(9, 30, generator=g, dtype=torch.float64) + 0.5
    for c in (0.05, 1.0, 50.0):
        J = torch.cat([honest, -c * honest.mean(0, keepdim=True)])
        assert float(JD.upgrad(J).norm()) < 1e-8 * float(JD.upgrad(honest).norm())


def test_per_example_and_client_jacobians_match_autograd():
    torch.manual_seed(0)
    model = make_model("mlp", (5,), 3, hidden=(4,))
    theta = flatten_params(model)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    J = JD.per_example_jacobian(model, theta, x, y)
    for i in range(6):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        torch.testing.assert_close(J[i], torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    rows, losses = JD.client_jacobian(model, theta, [(x[:3], y[:3]), (x[3:], y[3:])])
    torch.testing.assert_close(rows[0], J[:3].mean(0))
    assert losses.shape == (2,)


def test_bad_input():
    with pytest.raises(ValueError, match="J must be"):
        JD.upgrad(torch.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        JD.upgrad(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="pref"):
        JD.upgrad(torch.eye(2), pref=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="reg_eps"):
        JD.upgrad(torch.eye(2), reg_eps=-1.0)
