"""FedLD (Zeng et al., MICCAI 2024): margin-control loss, principal-gradient aggregation, loss decomposition."""
import pytest
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.data.partition import make_partition
from fedlab_nb.methods.heterogeneity.fedld import (DecompositionProbe, MarginControlObjective, PrincipalGradientRule, client_losses,
                                     decompose, fedld, margin_control_loss, margin_penalty,
                                     principal_gradient_revise)
from fedlab_nb.models import make_model, param_spec


def official_style_revise(U, k_proportion=0.8):
    """A second, loop-by-loop reading of the official pcgrad_svd for one tensor (torch.svd of G, explicit sign
    vote, per-piece rescaling) — no guards, so only for well-conditioned inputs."""
    m = U.shape[0]
    _, s, e = torch.svd(U @ U.T / m)
    w = (U.T @ e).T
    k = int(len(s) * k_proportion)
    out = []
    for j in range(k):
        if sum(1 for i in range(m) if torch.dot(U[i], w[j]) >= 0) < m - sum(1 for i in range(m) if torch.dot(U[i], w[j]) >= 0):
            w[j] = -w[j]
    for i in range(m):
        r = torch.zeros_like(U[i])
        for j in range(k):
            piece = torch.dot(U[i], w[j]) / torch.dot(w[j], w[j]) * w[j]
            r += piece * s[j] / s.sum() * torch.norm(U[i]) / torch.norm(piece)
        out.append(r)
    return torch.stack(out)


def rand(m, d, seed=0):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_revise_matches_official_loop():
    U = rand(10, 40)
    assert torch.allclose(principal_gradient_revise(U), official_style_revise(U.clone()), atol=1e-10, rtol=0)


def test_identical_updates_return_that_update():
    u = rand(1, 30)[0]
    U = u.repeat(7, 1)
    assert (principal_gradient_revise(U) - U).abs().max() < 1e-10
    spec = [("w", (5, 6))]
    rule = PrincipalGradientRule(spec)
    state = {"started": torch.ones(())}
    agg, _ = rule.aggregate(state, U, torch.ones(7))
    assert (agg - u).abs().max() < 1e-10


def test_order_invariance():
    U, spec = rand(10, 23, seed=1), [("a", (4, 5)), ("b", (2,)), ("c", (1,))]
    rule, state = PrincipalGradientRule(spec), {"started": torch.ones(())}
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    a, _ = rule.aggregate(state, U, torch.ones(10))
    b, _ = rule.aggregate(state, U[perm], torch.ones(10))
    assert (a - b).abs().max() < 1e-10


def test_first_round_and_scalars_use_plain_mean():
    U, spec = rand(6, 11, seed=2), [("w", (10,)), ("bias", (1,))]
    rule = PrincipalGradientRule(spec)
    first, state = rule.aggregate(rule.init_state(torch.zeros(11), 6), U, torch.ones(6))
    assert torch.allclose(first, U.mean(0), atol=1e-12)
    later, _ = rule.aggregate(state, U, torch.ones(6))
    assert torch.allclose(later[-1], U[:, -1].mean(), atol=1e-12)         # the scalar tensor
    assert not torch.allclose(later[:-1], U[:, :-1].mean(0), atol=1e-6)   # the vector tensor is revised


def test_revision_shrinks_each_update_by_the_kept_spectrum():
    U = rand(10, 50, seed=4)
    s = torch.linalg.eigvalsh(U @ U.T / 10).flip(0)
    expected = torch.sqrt(((s[:8] / s.sum()) ** 2).sum())
    ratio = principal_gradient_revise(U).norm(dim=1) / U.norm(dim=1)
    assert torch.allclose(ratio, expected.expand(10), atol=1e-10) and expected < 1


def test_degenerate_inputs_give_no_nan():
    assert principal_gradient_revise(torch.zeros(5, 8)).abs().max() == 0
    low_rank = rand(10, 3, seed=5)                 # m > d: G has rank 3, the 0/0 of the official code
    out = principal_gradient_revise(low_rank)
    assert torch.isfinite(out).all()
    out32 = principal_gradient_revise(rand(2, 4).float().repeat(3, 1))
    assert torch.isfinite(out32).all() and out32.dtype == torch.float32


def test_sign_flip_of_direction_is_a_no_op():
    # the projection is even in v_j, so the majority-sign calibration cannot change the result
    U = rand(8, 20, seed=6)
    assert torch.allclose(principal_gradient_revise(U), principal_gradient_revise(-U).neg(), atol=1e-12)


def test_decompose_sums_to_global():
    g = torch.Generator().manual_seed(0)
    cross, glob, p = torch.rand(6, 6, generator=g), torch.rand(6, generator=g), torch.rand(6, generator=g)
    for weights in (None, p):
        t = decompose(cross, glob, weights)
        assert abs(t["local"] + t["shift"] + t["aggregation"] - t["global"]) < 1e-12
    t = decompose(cross, glob)            # official logging: L = Σ_j L_j, averages over i
    m = 6
    assert abs(t["local"] - cross.diagonal().double().sum()) < 1e-12
    assert abs(t["shift"] - (cross.double().sum(1) - m * cross.diagonal().double()).mean()) < 1e-12
    assert abs(t["aggregation"] - (glob.double().sum() - cross.double().sum(1).mean())) < 1e-12


def test_margin_penalty_matches_formula_and_penalises_confidence():
    z = torch.randn(16, 10, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1))
    expected = F.cross_entropy(z, y) + 0.1 * torch.log(1 + torch.norm(torch.softmax(z, 1), p=2) ** 2)
    assert torch.allclose(margin_control_loss(z, y, 0.1), expected)
    assert margin_penalty(10 * z, 1.0) > margin_penalty(z, 1.0) > margin_penalty(0 * z, 1.0)


def small_fed(seed=0):
    ds = fl.load_dataset("digits")
    return FederatedDataset(ds, make_partition("dirichlet", ds.y_train.numpy(), 4, alpha=0.5, seed=seed), seed=seed)


def test_margin_objective_changes_training_and_probe_is_exact():
    fed = small_fed()
    runs = {}
    for lam in (0.0, 0.5):
        torch.manual_seed(0)
        model = make_model("mlp", fed.input_shape, fed.num_classes)
        method = fedld(model, lam=lam)
        probe = DecompositionProbe(method.rule, model, fed.client_train)
        method.rule = probe
        h = fl.simulate(method, fed, model, rounds=2, lr=0.05, seed=0, progress=False, callback=probe.callback)
        runs[lam] = h.theta
        row = probe.rows[-1]
        assert len(probe.rows) == 2
        assert abs(row["local"] + row["shift"] + row["aggregation"] - row["global"]) < 1e-9
        x, y = torch.cat([x for x, _ in fed.client_train]), torch.cat([y for _, y in fed.client_train])
        direct = float(client_losses(model, h.theta, [(x, y)])[0])
        assert abs(direct - row["global"]) < 1e-5        # p = n_j/n: L is the loss on the pooled training data
    assert not torch.allclose(runs[0.0], runs[0.5])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="lam"):
        MarginControlObjective(-1.0)
    with pytest.raises(ValueError, match="k_proportion"):
        principal_gradient_revise(torch.ones(3, 2), k_proportion=0)
    with pytest.raises(ValueError, match="param_spec"):
        PrincipalGradientRule([])
    with pytest.raises(ValueError, match="columns"):
        PrincipalGradientRule([("w", (3,))]).aggregate({"started": torch.ones(())}, torch.ones(2, 4), None)
    with pytest.raises(ValueError, match="p must be"):
        DecompositionProbe(None, None, [], p="bad")


def test_ablation_names_and_parts():
    model = make_model("mlp", (1, 8, 8), 10)
    assert fedld(model).name == "fedld" and isinstance(fedld(model).rule, PrincipalGradientRule)
    assert fedld(model, principal=False).name == "fedld_margin" and not fedld(model, principal=False).vmappable
    assert fedld(model, margin=False).name == "fedld_agg" and fedld(model, margin=False).vmappable
    assert fedld(model).rule.sizes == [int(torch.Size(s).numel()) for _, s in param_spec(model)]
