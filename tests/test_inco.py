"""InCo Aggregation (Chan et al., ICLR 2024) and depth-heterogeneous sub-models: the cross-layer gradient on
hand-made vectors, its coefficient against a numerical solve of the convex problem (scipy), exact sub-models,
blocks nobody holds never moving, the per-holder mean, and the errors."""
import importlib
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize, minimize_scalar

import fedlab_nb as fl
from fedlab_nb.core.method import RoundInfo, ServerSGD
from fedlab_nb.core.messages import Messages
from fedlab_nb.models import flatten_params, load_flat, param_spec

hd = importlib.import_module("fedlab_nb.methods.personalisation.hetero_depth")
ic = importlib.import_module("fedlab_nb.methods.personalisation.inco")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fed():
    return fl.federate("digits", "dirichlet", n_clients=6, alpha=0.3, seed=0)


def _net(blocks=4, width=16, seed=0):
    torch.manual_seed(seed)
    return hd.ResidualMLP(64, 10, width, blocks)


# --- the cross-layer gradient ---------------------------------------------------------------------------
def test_cross_layer_gradient_by_hand():
    g0, gk = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([-1.0, 1.0], dtype=torch.float64)
    beta = 1 / (1 + ic.EPS)                                   # |<g0, gk>| / |g0|² = 1
    assert float(ic.cross_layer_coefficient(gk, g0)) == pytest.approx(beta, abs=1e-15)
    nk, n0 = math.sqrt(2), 1.0
    want = (np.array([-1, 1]) / (nk + ic.EPS) + beta * np.array([1, 0]) / (n0 + ic.EPS)) * (nk + n0) / 2
    got = ic.cross_layer_gradient(gk, g0, clip=None).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(got, [(1 - 1 / nk) * (nk + 1) / 2, (nk + 1) / (2 * nk)], atol=1e-6)
    clipped = ic.cross_layer_gradient(gk, g0, clip=0.1)
    assert torch.equal(clipped, torch.tensor(want).clamp(-0.1, 0.1))


def test_coefficient_solves_the_convex_problem():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        g0, gk = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
        # min_β ‖g_k + β g_0‖² numerically: the coefficient is the size of its minimiser
        best = minimize_scalar(lambda b: float(((gk + b * g0) ** 2).sum()), bracket=(-10, 10), tol=1e-12).x
        assert float(ic.cross_layer_coefficient(gk, g0, beta_max=100)) == pytest.approx(abs(best), rel=1e-6)
    # conflicting directions: g_k + β g_0 is the projection of g_k onto {g : <g, g_0> >= 0} (the GEM primal)
    g0, gk = torch.tensor([1.0, 0.5, -0.2], dtype=torch.float64), torch.tensor([-0.8, 0.3, 0.4], dtype=torch.float64)
    assert float(g0 @ gk) < 0
    primal = minimize(lambda v: 0.5 * ((v - gk.numpy()) ** 2).sum(), gk.numpy(), method="SLSQP",
                      constraints=[{"type": "ineq", "fun": lambda v: v @ g0.numpy()}], options={"ftol": 1e-14})
    ours = gk + ic.cross_layer_coefficient(gk, g0) * g0
    np.testing.assert_allclose(ours.numpy(), primal.x, atol=1e-6)
    assert abs(float(ours @ g0)) < 1e-6


def test_coefficient_is_clamped_and_shapes_are_checked():
    gk, g0 = torch.ones(4), torch.full((4,), 1e-3)
    assert float(ic.cross_layer_coefficient(gk, g0, beta_max=5.0)) == 5.0
    with pytest.raises(ValueError, match="same shape"):
        ic.cross_layer_gradient(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="beta_max"):
        ic.InCoStep([], beta_max=-1.0)


def test_inco_step_edits_only_deep_layers():
    layout = hd.DepthLayout.of(_net(), [4] * 3)
    step = ic.InCoStep(ic.inco_pairs(layout), ServerSGD(), clip=None)
    theta = torch.zeros(sum(math.prod(s) for _, s in layout.spec))
    update = torch.randn(theta.shape, generator=torch.Generator().manual_seed(0)) * 0.01
    new, state = step.step(theta, update, step.init_state(theta, 3))
    sl = layout.slices()
    deep = torch.zeros_like(update, dtype=torch.bool)
    for j in (1, 2, 3):
        deep[sl[f"blocks.{j}.weight"]] = True
        want = ic.cross_layer_gradient(update[sl[f"blocks.{j}.weight"]], update[sl["blocks.0.weight"]], clip=None)
        assert torch.equal(new[sl[f"blocks.{j}.weight"]], want)
    assert torch.equal(new[~deep], update[~deep])
    assert math.isfinite(step.metrics(state)["inco_beta"])


# --- sub-models ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_depth_view_is_an_exact_submodel(depth):
    net = _net()
    view = hd.DepthView(net, depth)
    assert param_spec(view) == param_spec(net)             # the same flat layout
    small = hd.ResidualMLP(64, 10, 16, depth)
    state = {k: v for k, v in net.state_dict().items() if not k.startswith("blocks.") or int(k.split(".")[1]) < depth}
    small.load_state_dict(state)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(view(x), small(x))
    load_flat(net, flatten_params(net) + 1.0)              # shared tensors, not copies
    assert torch.equal(view.head.weight, net.head.weight)


@pytest.mark.parametrize("inco", [False, True])
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_blocks_nobody_holds_never_move(fed, inco, backend):
    net = _net()
    theta0 = flatten_params(net)
    method = ic.inco(net, depths=[2] * fed.num_clients, enabled=inco)
    h = fl.simulate(method, fed, net, rounds=2, lr=0.1, seed=0, progress=False, backend=backend)
    layout = method.rule.layout
    held = layout.held(2)
    assert torch.equal(h.theta[~held], theta0[~held])
    assert (h.theta[held] != theta0[held]).any()
    want = int(held.sum()) * 4 + 8 * 1                     # float32 Δ of the held tensors + the int64 depth
    assert int(h.bytes_up.iloc[0]) == fed.num_clients * want


def test_loop_and_vmap_agree(fed):
    runs = [fl.simulate(ic.inco(_net(), n_clients=fed.num_clients), fed, _net(), rounds=2, lr=0.1, seed=0,
                        progress=False, backend=b).theta for b in ("loop", "vmap")]
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def test_held_mean_by_hand():
    layout = hd.DepthLayout.of(_net(blocks=3, width=4), [1, 2, 3])
    D = sum(math.prod(s) for _, s in layout.spec)
    g = torch.Generator().manual_seed(0)
    held = torch.stack([layout.held(d) for d in (1, 2, 3)])
    deltas = torch.randn(3, D, generator=g, dtype=torch.float64) * held
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    info = RoundInfo(0, np.arange(3), w, w, 3, 0.1, messages=Messages({"delta": deltas, "depth": torch.tensor([1, 2, 3])},
                                                                       np.arange(3)))
    rule = hd.HeldMean(layout)
    agg, state = rule.aggregate(rule.init_state(deltas[0], 3), deltas, w, info=info)
    sl = layout.slices()
    torch.testing.assert_close(agg[sl["stem.weight"]], (w @ deltas[:, sl["stem.weight"]]) / 6)
    torch.testing.assert_close(agg[sl["blocks.1.weight"]], (w[1:] @ deltas[1:, sl["blocks.1.weight"]]) / 5)
    torch.testing.assert_close(agg[sl["blocks.2.bias"]], deltas[2, sl["blocks.2.bias"]])
    assert set(rule.metrics(state)) == {f"sim_{k}" for k in ("stem", "block0", "block1", "block2", "head")}
    assert math.isnan(rule.metrics(state)["sim_block2"])   # one holder: no pair to compare


def test_scaffold_state_stays_put_on_missing_blocks(fed):
    net = _net()
    method = ic.inco(net, base="scaffold", depths=[2] * fed.num_clients)
    h = fl.simulate(method, fed, net, rounds=2, lr=0.1, seed=0, progress=False)
    held = method.rule.layout.held(2)
    c_k = h.store.all("cpu")["objective.c_k"]
    assert torch.equal(c_k[:, ~held], torch.zeros_like(c_k[:, ~held]))
    assert (c_k[:, held] != 0).any()


def test_errors_name_the_fix():
    net = _net()
    with pytest.raises(ValueError, match="depths must be in 1"):
        ic.inco(net, depths=[5, 2])
    with pytest.raises(ValueError, match="FedAvg-family"):
        ic.inco(net, base="ditto", n_clients=3)
    with pytest.raises(ValueError, match="ResidualMLP"):
        hd.DepthLayout.of(torch.nn.Linear(2, 2), [1])
    with pytest.raises(ValueError, match="n_clients"):
        hd.depth_groups(2, (2, 3, 4))
    assert hd.depth_groups(10).tolist() == [2, 2, 2, 2, 3, 3, 3, 4, 4, 4]
