"""Personalisation and heterogeneity baselines (issue 11): each method's core against a hand-written loop on a
tiny problem, on both kernels where the method is vmappable."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.core.method import LocalContext
from fedlab_nb.engine.client import make_loss
from fedlab_nb.engine.server import RunConfig, build_model, local_job
from fedlab_nb.models import flatten_params, load_flat

LR = 0.1


def _fixed(ids):
    return lambda r, K, g: np.array(ids)


def _batches(fed, k, r, lr=LR, **cfg):
    """Client k's mini-batch schedule in round r (track 0), as the engine draws it."""
    return local_job(fed, k, RunConfig(seed=0, lr=lr, **cfg), r, None).batches


# --- FedDyn ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_feddyn_matches_hand_written(digits_fed, backend):
    """Two rounds: local steps on L_k − ⟨g_k, w⟩ + α/2‖w − θ‖², g_k ← g_k − αΔ_k, h ← h − α/K ΣΔ_k,
    θ ← mean θ_k − h/α — by hand."""
    alpha, ids, K = 0.3, [1, 4, 6], digits_fed.num_clients
    h = fl.simulate(fl.get_method("feddyn", alpha=alpha), digits_fed, model="logreg", rounds=2,
                    clients_per_round=_fixed(ids), lr=LR, progress=False, backend=backend)
    model = build_model("logreg", digits_fed, 0)
    loss, theta = make_loss(model), flatten_params(model)
    g, hs = torch.zeros(K, theta.numel()), torch.zeros_like(theta)
    for r in range(2):
        deltas = []
        for k in ids:
            x, y = digits_fed.client_train[k]
            w = theta.clone()
            for idx in _batches(digits_fed, k, r):
                w = w - LR * (torch.func.grad(loss)(w, x[idx], y[idx]) - g[k] + alpha * (w - theta))
            deltas.append(w - theta)
            g[k] = g[k] - alpha * (w - theta)
        D = torch.stack(deltas)
        hs = hs - alpha / K * D.sum(0)
        theta = (theta + D).mean(0) - hs / alpha
    torch.testing.assert_close(h.theta, theta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.store.all("cpu")["objective.g"], g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.state["rule"]["h"], hs, atol=1e-6, rtol=1e-5)


# --- MOON -----------------------------------------------------------------------------------------------------
def _moon_reference(fed, ids, rounds, mu, tau, hidden):
    """MOON by hand with nn.Modules and autograd: CE + μ·ℓ_con on the penultimate layer."""
    net = build_model("mlp", fed, 0, {"hidden": hidden})
    theta = flatten_params(net)
    prev = {}
    for r in range(rounds):
        glob = load_flat(copy.deepcopy(net), theta)
        new, sizes = [], []
        for k in ids:
            x, y = fed.client_train[k]
            local = load_flat(copy.deepcopy(net), theta)
            old = load_flat(copy.deepcopy(net), prev.get(k, theta))
            for idx in _batches(fed, k, r):
                xb, yb = x[idx], y[idx]
                z = local.representation(xb)
                with torch.no_grad():
                    zg, zp = glob.representation(xb), old.representation(xb)
                pos, neg = F.cosine_similarity(z, zg, dim=1) / tau, F.cosine_similarity(z, zp, dim=1) / tau
                con = -(pos - torch.logsumexp(torch.stack([pos, neg], 1), 1))
                total = F.cross_entropy(local(xb), yb) + mu * con.mean()
                local.zero_grad()
                total.backward()
                with torch.no_grad():
                    for p in local.parameters():
                        p -= LR * p.grad
            prev[k] = flatten_params(local)
            new.append(prev[k])
            sizes.append(float(len(y)))
        p = torch.tensor(sizes) / sum(sizes)
        theta = theta + p @ (torch.stack(new) - theta)
    return theta, prev


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_moon_matches_hand_written(digits_fed, backend):
    """Two rounds, so the second contrasts against the stored previous local models."""
    mu, tau, ids, hidden = 2.0, 0.5, [0, 3], (8,)
    h = fl.simulate(fl.get_method("moon", mu=mu, tau=tau), digits_fed, model="mlp", model_kwargs={"hidden": hidden},
                    rounds=2, clients_per_round=_fixed(ids), lr=LR, progress=False, backend=backend)
    theta, prev = _moon_reference(digits_fed, ids, 2, mu, tau, hidden)
    torch.testing.assert_close(h.theta, theta, atol=1e-5, rtol=1e-4)
    store = h.store.all("cpu")
    for k in ids:
        torch.testing.assert_close(store["objective.prev"][k], prev[k], atol=1e-5, rtol=1e-4)
    assert store["objective.has_prev"][ids].eq(1).all() and store["objective.has_prev"].sum() == len(ids)


def test_moon_contrastive_term_changes_the_update(digits_fed):
    """μ = 0 is FedAvg exactly; μ > 0 differs once a previous model exists (round 2)."""
    kw = dict(model="mlp", model_kwargs={"hidden": (8,)}, rounds=2, clients_per_round=_fixed([0, 3]), lr=LR,
              progress=False)
    a = fl.simulate(fl.get_method("moon", mu=0.0), digits_fed, **kw)
    b = fl.simulate("fedavg", digits_fed, **kw)
    c = fl.simulate(fl.get_method("moon", mu=5.0), digits_fed, **kw)
    torch.testing.assert_close(a.theta, b.theta)
    assert not torch.allclose(c.theta, b.theta)


def test_moon_needs_a_representation(digits_fed):
    with pytest.raises(TypeError, match="representation"):
        fl.simulate("moon", digits_fed, model="logreg", rounds=1, progress=False, backend="loop")


# --- pFedMe ---------------------------------------------------------------------------------------------------
def test_pfedme_matches_hand_written(digits_fed):
    """One round, β = 0.5: K inner steps on f(θ; B) + λ/2‖θ − w‖² per batch, w ← w − ηλ(w − θ), then
    θ_glob ← (1 − β)θ_glob + β Σ p_k w_k; the last θ is each client's personal model."""
    lam, plr, K, beta, ids = 2.0, 0.05, 3, 0.5, [2, 5]
    h = fl.simulate(fl.get_method("pfedme", lam=lam, personal_lr=plr, inner_steps=K, beta=beta), digits_fed,
                    model="logreg", rounds=1, clients_per_round=_fixed(ids), lr=LR, progress=False)
    model = build_model("logreg", digits_fed, 0)
    glob = flatten_params(model)
    ws, sizes, personal = [], [], {}
    for k in ids:
        x, y = digits_fed.client_train[k]
        w, th = glob.clone(), glob.clone()
        for idx in _batches(digits_fed, k, 0):
            for _ in range(K):
                th = th.detach().requires_grad_(True)
                (gr,) = torch.autograd.grad(F.cross_entropy(torch.func.functional_call(
                    model, {"linear.weight": th[:-10].view(10, -1), "linear.bias": th[-10:]}, (x[idx],)), y[idx]), th)
                th = (th - plr * (gr + lam * (th - w))).detach()
            w = w - LR * lam * (w - th)
        ws.append(w)
        sizes.append(float(len(y)))
        personal[k] = th
    p = torch.tensor(sizes) / sum(sizes)
    torch.testing.assert_close(h.theta, (1 - beta) * glob + beta * (p @ torch.stack(ws)), atol=1e-6, rtol=1e-5)
    store = h.store.all("cpu")["personal"]
    for k in ids:
        torch.testing.assert_close(store[k], personal[k], atol=1e-6, rtol=1e-5)
    assert torch.equal(store[0], glob)                         # never sampled: its default θ_k = w⁰
    assert {"personal_acc_mean", "client_acc_mean"} <= set(h.columns)


# --- Per-FedAvg -----------------------------------------------------------------------------------------------
def _per_fedavg_reference(fed, ids, alpha, beta, hf):
    """One round of Per-FedAvg by hand (autograd, the Hessian-vector product by double backward)."""
    model = build_model("logreg", fed, 0)
    loss, theta = make_loss(model), flatten_params(model)
    ws = []
    for k in ids:
        x, y = fed.client_train[k]
        bs, per = _batches(fed, k, 0, lr=beta), 3 if hf else 2
        w = theta.clone()
        for s in range(len(bs) // per):
            d, d1 = bs[s * per], bs[s * per + 1]
            wv = w.detach().requires_grad_(True)
            (g0,) = torch.autograd.grad(loss(wv, x[d], y[d]), wv, create_graph=hf)
            wt = (wv - alpha * g0).detach().requires_grad_(True)
            (g1,) = torch.autograd.grad(loss(wt, x[d1], y[d1]), wt)
            if hf:  # ∇²f(w; D'') g1 by double backward on the third batch
                d2 = bs[s * per + 2]
                (g2,) = torch.autograd.grad(loss(wv, x[d2], y[d2]), wv, create_graph=True)
                (hv,) = torch.autograd.grad(g2 @ g1, wv)
                g1 = g1 - alpha * hv
            w = (w - beta * g1).detach()
        ws.append(w)
    return theta + (torch.stack(ws) - theta).mean(0), loss


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_per_fedavg_matches_hand_written(digits_fed, variant):
    alpha, beta, ids = 0.05, LR, [1, 7]
    h = fl.simulate(fl.get_method("per_fedavg", alpha=alpha, variant=variant), digits_fed, model="logreg", rounds=1,
                    clients_per_round=_fixed(ids), lr=beta, progress=False)
    theta, loss = _per_fedavg_reference(digits_fed, ids, alpha, beta, variant == "hf")
    torch.testing.assert_close(h.theta, theta, atol=1e-6, rtol=1e-5)


def test_per_fedavg_hf_differs_from_fo(digits_fed):
    kw = dict(model="logreg", rounds=1, clients_per_round=_fixed([1, 7]), lr=LR, progress=False)
    fo = fl.simulate(fl.get_method("per_fedavg", alpha=0.5, variant="fo"), digits_fed, **kw)
    hf = fl.simulate(fl.get_method("per_fedavg", alpha=0.5, variant="hf"), digits_fed, **kw)
    assert not torch.allclose(fo.theta, hf.theta)


def test_per_fedavg_personal_model_is_one_adaptation_step(digits_fed):
    """personal(θ)[k] = θ − α∇f_k(θ; D_k) for every client, sampled or not."""
    method = fl.get_method("per_fedavg", alpha=0.3)
    model = build_model("logreg", digits_fed, 0)
    loss, theta = make_loss(model), flatten_params(model)
    P = method.client.personal_at_evaluation(method, theta, {}, LocalContext(lr=LR, loss_fn=loss, fed=digits_fed), {})
    assert P.shape == (digits_fed.num_clients, theta.numel())
    for k, (x, y) in enumerate(digits_fed.client_train):
        torch.testing.assert_close(P[k], theta - 0.3 * torch.func.grad(loss)(theta, x, y))


# --- IFCA -----------------------------------------------------------------------------------------------------
def _two_group_fed():
    """Digits over 6 clients; clients 3–5 see every label shifted by 5: two hidden groups, separable by loss."""
    fed = fl.federate("digits", "iid", n_clients=6, seed=0)
    for split in (fed.client_train, fed.client_test):
        for k in (3, 4, 5):
            x, y = split[k]
            split[k] = (x, (y + 5) % 10)
    return fed


def _group_models(fed, steps=30):
    """One logreg model per hidden group, trained by full-batch GD on that group's pooled data."""
    model = build_model("logreg", fed, 0)
    loss, theta = make_loss(model), flatten_params(model)
    out = []
    for group in ([0, 1, 2], [3, 4, 5]):
        x = torch.cat([fed.client_train[k][0] for k in group])
        y = torch.cat([fed.client_train[k][1] for k in group])
        w = theta.clone()
        for _ in range(steps):
            w = w - 0.5 * torch.func.grad(loss)(w, x, y)
        out.append(w)
    return torch.stack(out), loss


def test_ifca_assignment_recovers_separable_groups():
    from fedlab_nb.methods.personalisation.ifca import assignments
    fed = _two_group_fed()
    models, loss = _group_models(fed)
    np.testing.assert_array_equal(assignments(loss, models, fed), [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(assignments(loss, models.flip(0), fed), [1, 1, 1, 0, 0, 0])


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_ifca_round_matches_hand_written(backend):
    """One round with clients {0, 1, 4}: each picks argmin_j F_i(θ_j), trains from it; cluster j ← mean of
    its clients' models; the store holds the choices; personal model = the chosen cluster's model."""
    fed = _two_group_fed()
    models, loss = _group_models(fed, steps=5)
    ids = [0, 1, 4]
    h = fl.simulate(fl.get_method("ifca", init_models=models), fed, model="logreg", rounds=1,
                    clients_per_round=_fixed(ids), lr=LR, progress=False, backend=backend)
    trained = {}
    for k in ids:
        x, y = fed.client_train[k]
        j = int(torch.stack([loss(m, x, y) for m in models]).argmin())
        w = models[j].clone()
        for idx in _batches(fed, k, 0):
            w = w - LR * torch.func.grad(loss)(w, x[idx], y[idx])
        trained[k] = (j, w)
    assert [trained[k][0] for k in ids] == [0, 0, 1]
    expect = torch.stack([(trained[0][1] + trained[1][1]) / 2, trained[4][1]])
    torch.testing.assert_close(h.state["objective"]["models"], expect, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(h.store.all("cpu")["cluster"].numpy(), [0, 0, -1, -1, 1, -1])
    torch.testing.assert_close(h.theta, torch.stack([trained[k][1] for k in ids]).mean(0), atol=1e-5, rtol=1e-5)
    assert h["personal_acc_mean"].iloc[-1] > h["client_acc_mean"].iloc[-1]  # cluster models beat one average


def test_ifca_keeps_an_unchosen_cluster():
    from fedlab_nb.methods.personalisation.ifca import cluster_average
    models = torch.arange(6.).view(3, 2)
    new = cluster_average(models, torch.zeros(2), torch.tensor([[1., 1.], [3., 3.]]), torch.tensor([2, 2]))
    torch.testing.assert_close(new, torch.tensor([[0., 1.], [2., 3.], [2., 2.]]))


# --- CFL ------------------------------------------------------------------------------------------------------
def _best_bipartition(S):
    """The paper's optimal split by brute force: the bipartition with the smallest max cross-similarity."""
    import itertools
    n, best = len(S), None
    for r in range(1, n // 2 + 1):
        for part in itertools.combinations(range(n), r):
            rest = [i for i in range(n) if i not in part]
            cross = S[np.ix_(list(part), rest)].max()
            if best is None or cross < best[0]:
                best = (cross, set(part))
    labels = np.array([int(i in best[1]) for i in range(n)])
    return labels if labels[0] == 0 else 1 - labels


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_cfl_split_matches_hand_written(backend):
    """Round 1 with the split forced (ε₁ huge, ε₂ = 0, no warm-up): the clients are bi-partitioned by the
    cosine of their updates into the hidden groups, each part gets θ + its members' mean update."""
    from fedlab_nb.methods.personalisation.cfl import bipartition, cosine_matrix
    fed = _two_group_fed()
    h = fl.simulate(fl.get_method("cfl", eps1=1e9, eps2=0.0, warmup=0), fed, model="logreg", rounds=1, lr=LR,
                    progress=False, backend=backend)
    model = build_model("logreg", fed, 0)
    loss, theta = make_loss(model), flatten_params(model)
    dW = []
    for k in range(6):
        x, y = fed.client_train[k]
        w = theta.clone()
        for idx in _batches(fed, k, 0):
            w = w - LR * torch.func.grad(loss)(w, x[idx], y[idx])
        dW.append(w - theta)
    dW = torch.stack(dW)
    S = cosine_matrix(dW)
    labels = _best_bipartition(S)
    np.testing.assert_array_equal(labels, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(bipartition(S), labels)
    np.testing.assert_array_equal(h.state["objective"]["assign"].numpy(), labels)
    expect = torch.stack([theta + dW[:3].mean(0), theta + dW[3:].mean(0)])
    torch.testing.assert_close(h.state["objective"]["models"], expect, atol=1e-5, rtol=1e-5)
    assert "personal_acc_mean" in h.columns


def test_cfl_does_not_split_without_the_criterion():
    fed = _two_group_fed()
    kw = dict(model="logreg", rounds=2, lr=LR, progress=False)
    far = fl.simulate(fl.get_method("cfl", eps1=1e-9, eps2=0.0, warmup=0), fed, **kw)       # mean update not small
    small = fl.simulate(fl.get_method("cfl", eps1=1e9, eps2=1e9, warmup=0), fed, **kw)      # no client far off
    late = fl.simulate(fl.get_method("cfl", eps1=1e9, eps2=0.0, warmup=5), fed, **kw)       # still warming up
    few = fl.simulate(fl.get_method("cfl", eps1=1e9, eps2=0.0, warmup=0), fed, clients_per_round=2, **kw)  # |c| ≤ 2
    for h in (far, small, late, few):
        assert len(h.state["objective"]["models"]) == 1 and h.state["objective"]["assign"].eq(0).all()


# --- FedProto -------------------------------------------------------------------------------------------------
def _fedproto_reference(fed, ids, rounds, lam, hidden):
    """FedProto by hand with nn.Modules: local models only; CE + λ·MSE(f(x), C̄^y) on rows whose class has a
    global prototype; prototypes = per-class mean representation after training; C̄ = mean over holders."""
    net = build_model("mlp", fed, 0, {"hidden": hidden})
    C = fed.num_classes
    local = {k: copy.deepcopy(net) for k in ids}
    glob = None
    for r in range(rounds):
        sent = []
        for k in ids:
            x, y = fed.client_train[k]
            m = local[k]
            for idx in _batches(fed, k, r):
                xb, yb = x[idx], y[idx]
                total = F.cross_entropy(m(xb), yb)
                if glob is not None:
                    protos, avail = glob
                    z = m.representation(xb)
                    total = total + lam * (avail[yb] * ((z - protos[yb]) ** 2).mean(1)).mean()
                m.zero_grad()
                total.backward()
                with torch.no_grad():
                    for p in m.parameters():
                        p -= LR * p.grad
            with torch.no_grad():
                z = m.representation(x)
            sent.append({c: z[y == c].mean(0) for c in range(C) if (y == c).any()})
        h = next(iter(sent[0].values())).numel()
        protos, avail = torch.zeros(C, h), torch.zeros(C)
        for c in range(C):
            have = [s[c] for s in sent if c in s]
            if have:
                protos[c], avail[c] = torch.stack(have).mean(0), 1.0
        glob = (protos, avail)
    return {k: flatten_params(m) for k, m in local.items()}, glob


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_fedproto_matches_hand_written(digits_fed, backend):
    lam, ids, hidden = 0.5, [0, 3], (8,)
    h = fl.simulate(fl.get_method("fedproto", lam=lam), digits_fed, model="mlp", model_kwargs={"hidden": hidden},
                    rounds=2, clients_per_round=_fixed(ids), lr=LR, progress=False, backend=backend)
    models, (protos, avail) = _fedproto_reference(digits_fed, ids, 2, lam, hidden)
    store = h.store.all("cpu")["model"]
    for k in ids:
        torch.testing.assert_close(store[k], models[k], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h.state["objective"]["protos"], protos, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h.state["objective"]["avail"], avail)
    theta0 = flatten_params(build_model("mlp", digits_fed, 0, {"hidden": hidden}))
    assert torch.equal(h.theta, theta0)                      # no weights are shared
    assert "personal_acc_mean" in h.columns


# --- FedALA ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_fedala_matches_hand_written(digits_fed, backend):
    """Round 1: ALA off (w = θ), plain local SGD, FedAvg. Round 2: W learned on the s% slice for max_epochs
    (threshold 0) on the last p = 2 tensors, ŵ = θ below / w + (θ − w) ⊙ W on top; then local SGD from ŵ."""
    from fedlab_nb.methods.personalisation.fedala import ALA_SLICE
    from fedlab_nb.utils import rng
    ids, eta, s, epochs = [2, 6], 0.5, 50, 3
    h = fl.simulate(fl.get_method("fedala", eta=eta, rand_percent=s, layer_idx=2, threshold=0.0, max_epochs=epochs),
                    digits_fed, model="mlp", model_kwargs={"hidden": (8,)}, rounds=2, clients_per_round=_fixed(ids),
                    lr=LR, progress=False, backend=backend)
    model = build_model("mlp", digits_fed, 0, {"hidden": (8,)})
    loss, theta = make_loss(model), flatten_params(model)
    n_top = sum(p.numel() for p in list(model.parameters())[-2:])
    local, Ws = {}, {k: torch.ones_like(theta) for k in ids}

    def sgd(k, w, r):
        x, y = digits_fed.client_train[k]
        for idx in _batches(digits_fed, k, r):
            w = w - LR * torch.func.grad(loss)(w, x[idx], y[idx])
        return w

    for r in range(2):
        trained, sizes = [], []
        for k in ids:
            x, y = digits_fed.client_train[k]
            if r == 0:
                start = theta.clone()
            else:
                w, W = local[k], Ws[k]
                take = int(s / 100 * len(y))
                a = int(rng(0, ALA_SLICE, r, k).integers(0, len(y) - take + 1))
                xs, ys = x[a:a + take], y[a:a + take]
                lo = theta[:-n_top]
                for _ in range(epochs):
                    for i in range(0, take, 32):
                        hat = torch.cat([lo, w[-n_top:] + (theta[-n_top:] - w[-n_top:]) * W[-n_top:]])
                        g = torch.func.grad(loss)(hat, xs[i:i + 32], ys[i:i + 32])
                        W = torch.cat([W[:-n_top], (W[-n_top:] - eta * g[-n_top:] * (theta[-n_top:] - w[-n_top:])).clamp(0, 1)])
                Ws[k] = W
                start = torch.cat([lo, w[-n_top:] + (theta[-n_top:] - w[-n_top:]) * W[-n_top:]])
            local[k] = sgd(k, start, r)
            trained.append(local[k])
            sizes.append(float(len(y)))
        p = torch.tensor(sizes) / sum(sizes)
        theta = theta + p @ (torch.stack(trained) - theta)
    store = h.store.all("cpu")
    torch.testing.assert_close(h.theta, theta, atol=1e-5, rtol=1e-4)
    for k in ids:
        torch.testing.assert_close(store["model"][k], local[k], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(store["weights"][k], Ws[k], atol=1e-5, rtol=1e-4)
    assert not torch.equal(store["weights"][ids[0]], torch.ones_like(theta))   # the weights were learned
    assert store["learned"][ids].eq(1).all()
