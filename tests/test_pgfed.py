"""PGFed (Luo et al., ICCV 2023): the first-order approximation, the gradients of the personalised global
objective, the a_ij step, and the method's identities on the round pipeline."""
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.personalisation.pgfed import auxiliary_gradient, full_gradients, pgfed, taylor_risk, weight_step

torch.set_num_threads(1)


def quadratic(b):
    """f(θ) = ½‖θ − b‖²: ∇f(θ) = θ − b."""
    return lambda th: 0.5 * ((th - b) ** 2).sum(-1)


def test_taylor_risk_on_quadratic_by_hand():
    # f_j(θ) = ½‖θ − b_j‖² expanded at θ_j: f̃_j(θ) = f_j(θ_j) + ⟨θ_j − b_j, θ − θ_j⟩
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    th_j = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    f = quadratic(b)
    grads = th_j - b                                    # [[-1, 0], [1, -1]]
    c = f(th_j) - (grads * th_j).sum(1)                 # f_j(θ_j) − ⟨g_j, θ_j⟩ = [0.5, 1.0 − 0] = [0.5, 1.0]
    assert torch.equal(c, torch.tensor([0.5, 1.0], dtype=torch.float64))
    theta = torch.tensor([2.0, 3.0], dtype=torch.float64)
    # by hand: j=0: 0.5 + ⟨(-1, 0), (2, 3)⟩ = -1.5; j=1: 1.0 + ⟨(1, -1), (2, 3)⟩ = 0.0
    assert torch.equal(taylor_risk(c, grads, theta), torch.tensor([-1.5, 0.0], dtype=torch.float64))
    # the expansion's error on a quadratic is exactly ½‖θ − θ_j‖²
    err = f(theta) - taylor_risk(c, grads, theta)
    assert torch.allclose(err, 0.5 * ((theta - th_j) ** 2).sum(1))


def test_gradients_of_the_personalised_objective_match_autograd():
    g = torch.Generator().manual_seed(0)
    d, M = 5, 3
    b_i, grads, c = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(M, d, generator=g, dtype=torch.float64), \
        torch.randn(M, generator=g, dtype=torch.float64)
    a = torch.rand(1, M, generator=g, dtype=torch.float64)
    mu = 0.3
    theta = torch.randn(d, generator=g, dtype=torch.float64, requires_grad=True)
    a_var = a.clone().requires_grad_(True)
    F = quadratic(b_i)(theta) + mu * (a_var[0] * taylor_risk(c, grads, theta)).sum()   # F_i(θ, a_i)
    dtheta, da = torch.autograd.grad(F, (theta, a_var))
    assert torch.allclose(dtheta, (theta - b_i).detach() + auxiliary_gradient(a, grads, mu)[0])
    assert torch.allclose(da, mu * taylor_risk(c, grads, theta.detach()[None]))
    # the exact a step is projected gradient descent on F_i with step λ
    lam = 0.1
    step = weight_step(a, c, grads, theta.detach()[None], mu, lam, exact=True)
    assert torch.allclose(step, (a - lam * da).clamp_min(0))


def test_official_weight_step_uses_the_mean_gradient_and_clamps_at_zero():
    grads = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    c = torch.tensor([0.0, 10.0])
    W = torch.tensor([[2.0, 2.0]])
    a = torch.tensor([[0.5, 0.5]])
    # ⟨θ_i, (μ/M) Σ g⟩ = μ · ⟨(2, 2), (0.5, 1.5)⟩ = 4μ; slope_j = μ c_j + 4μ with μ = 0.1: [0.4, 1.4]
    out = weight_step(a, c, grads, W, mu=0.1, lam=0.5)
    assert torch.allclose(out, torch.tensor([[0.5 - 0.2, 0.0]]))   # 0.5 − 0.7 clamps to 0


def test_full_gradients_are_the_whole_data_gradient():
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.5, seed=0)
    model = fl.engine.server.build_model("mlp", fed, 0, {"hidden": (8,)})
    from fedlab_nb.engine.client import LocalJob, make_loss
    from fedlab_nb.models import flatten_params
    loss_fn = make_loss(model)
    theta = flatten_params(model)
    jobs = [LocalJob(k, *fed.client_train[k], []) for k in range(2)]
    W = torch.stack([theta, theta + 0.01])
    G, c = full_gradients(loss_fn, W, jobs)
    for i, job in enumerate(jobs):
        w = W[i].clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(torch.func.functional_call(
            model, fl.models.unflatten(w, fl.models.param_spec(model)), (job.x,)), job.y)
        (grad,) = torch.autograd.grad(loss, w)
        assert torch.allclose(G[i], grad, atol=1e-6)
        assert torch.allclose(c[i], loss.detach() - grad @ W[i], atol=1e-5)


def run(method, fed, rounds=3):
    return fl.simulate(method, fed, model="mlp", model_kwargs={"hidden": (8,)}, rounds=rounds, clients_per_round=3,
                       batch_size=16, lr=0.1, seed=1, eval_every=rounds, progress=False)


def test_mu_zero_is_fedavg_with_the_last_local_models():
    fed = fl.federate("digits", "dirichlet", n_clients=6, alpha=0.3, seed=1)
    h0, hf = run(pgfed(mu=0.0), fed), run(fl.get_method("fedavg"), fed)
    assert torch.allclose(h0.theta, hf.theta, atol=1e-6)         # the server keeps FedAvg's sample-weighted model
    h = run(pgfed(mu=0.5, lam=0.01), fed)
    assert (h.theta - hf.theta).abs().max() > 1e-4                # the auxiliary gradient moves the models
    a = h.state["objective"]["a"]
    assert torch.isfinite(a).all() and (a >= 0).all()
    assert h.state["objective"]["grads"].shape == (3, h.theta.numel())
    # the global model is the sample-weighted mean of the last round's personal models
    ids = h.state["objective"]["ids"]
    V = h.store.all("cpu")["v"][ids]
    n = torch.tensor([float(len(fed.client_train[int(k)][1])) for k in ids])
    assert torch.allclose((n / n.sum()) @ V, h.theta, atol=1e-6)


def test_loop_and_vmap_backends_agree():
    fed = fl.federate("digits", "dirichlet", n_clients=6, alpha=0.3, seed=1)
    kw = dict(model="mlp", model_kwargs={"hidden": (8,)}, rounds=3, clients_per_round=3, batch_size=16, lr=0.1,
              seed=1, eval_every=3, progress=False)
    hl = fl.simulate(pgfed(mu=0.5, beta=0.5), fed, backend="loop", **kw)
    hv = fl.simulate(pgfed(mu=0.5, beta=0.5), fed, backend="vmap", **kw)
    assert torch.allclose(hl.theta, hv.theta, atol=1e-5)
    assert torch.allclose(hl.state["objective"]["a"], hv.state["objective"]["a"], atol=1e-6)


@pytest.mark.parametrize("kw, word", [({"mu": -1}, "mu"), ({"lam": -0.1}, "lam"), ({"beta": 1.0}, "beta"),
                                      ({"a_grad": "full"}, "a_grad")])
def test_bad_parameters_are_named(kw, word):
    with pytest.raises(ValueError, match=word):
        pgfed(**kw)
