"""FedRoD and FedFomo (issue 11): each method's core against a hand-written reference on a tiny problem."""
import numpy as np
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.core.round import batch_schedule
from fedlab_nb.core.streams import BATCHES
from fedlab_nb.engine.client import make_loss
from fedlab_nb.engine.server import RunConfig, build_model, local_job
from fedlab_nb.methods.personalisation.fedfomo import FOMO_VAL, FedFomoClient, choose_models, fomo_weights
from fedlab_nb.methods.personalisation.fedrod import balanced_softmax_loss, class_log_prior
from fedlab_nb.models import flatten_params, load_flat
from fedlab_nb.utils import rng

LR = 0.1
MLP16 = dict(model="mlp", model_kwargs={"hidden": (16,)})


def only(*ids_per_round):
    return lambda r, K, g: np.array(ids_per_round[min(r, len(ids_per_round) - 1)])


# --- FedRoD -----------------------------------------------------------------------------------------------------
def test_balanced_softmax_equals_the_hand_formula():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, -2.0, 3.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([1, 2, 0])
    counts = torch.tensor([3.0, 1.0, 6.0, 0.0])                  # class 3 absent from the client
    log_prior = class_log_prior(torch.tensor([0] * 3 + [1] + [2] * 6), 4)
    torch.testing.assert_close(log_prior, (counts / 10).log())
    hand = []
    for row, c in zip(logits, y):
        num = counts[c] * torch.exp(row[c])
        hand.append(-torch.log(num / (counts * torch.exp(row)).sum()))
    torch.testing.assert_close(balanced_softmax_loss(logits, y, log_prior), torch.stack(hand).mean())
    # a uniform prior is plain cross-entropy
    torch.testing.assert_close(balanced_softmax_loss(logits, y, torch.full((4,), -np.log(4.0))), F.cross_entropy(logits, y))


def test_fedrod_one_client_one_round_equals_a_hand_loop(digits_fed):
    """nn.Module + autograd: body and generic head on the balanced softmax, the personal head on
    CE(g.detach() + h_P(z.detach())); Δ on the shared model only, h_P stored and never sent."""
    k = 3
    h = fl.simulate("fedrod", digits_fed, rounds=1, clients_per_round=only([k]), lr=LR, progress=False, **MLP16)
    net = build_model("mlp", digits_fed, 0, {"hidden": (16,)})
    d = flatten_params(net).numel()
    x, y = digits_fed.client_train[k]
    counts = torch.bincount(y, minlength=digits_fed.num_classes).float()
    Wp = torch.zeros(digits_fed.num_classes, 16, requires_grad=True)
    bp = torch.zeros(digits_fed.num_classes, requires_grad=True)
    for idx in local_job(digits_fed, k, RunConfig(lr=LR), 0, None).batches:
        xb, yb = x[idx], y[idx]
        z = net.body[:-1](xb)
        g = net.body[-1](z)
        l_g = F.cross_entropy(g + torch.log(counts / counts.sum()), yb)
        l_p = F.cross_entropy(g.detach() + z.detach() @ Wp.T + bp, yb)
        net.zero_grad()
        grads = torch.autograd.grad(l_g, list(net.parameters()))
        gp = torch.autograd.grad(l_p, [Wp, bp])
        with torch.no_grad():
            for p, gr in zip(net.parameters(), grads):
                p -= LR * gr
            Wp -= LR * gp[0]
            bp -= LR * gp[1]
    w = flatten_params(net)
    torch.testing.assert_close(h.theta, w, atol=1e-6, rtol=1e-5)     # one client: θ = its model
    heads = h.store.all("cpu")["phead"]
    torch.testing.assert_close(heads[k], torch.cat([Wp.detach().ravel(), bp.detach()]), atol=1e-6, rtol=1e-5)
    assert all(torch.equal(heads[c], torch.zeros_like(heads[c])) for c in range(len(heads)) if c != k)
    assert h["bytes_up"].iloc[0] == d * 4                              # the shared model only: h_P never sent
    # personal model = body + generic head + personal head, on the client's own test split
    with torch.no_grad():
        xt, yt = digits_fed.client_test[k]
        z = net.body[:-1](xt)
        acc = float(((net.body[-1](z) + z @ Wp.T + bp).argmax(1) == yt).float().mean())
    assert h.client_acc["personal model"][list(h.client_acc["client"]).index(k)] == acc


# --- FedFomo ----------------------------------------------------------------------------------------------------
def test_fomo_weights_on_a_hand_computed_case():
    own = torch.tensor(1.0)
    w, r = fomo_weights(own, torch.tensor([0.5, 0.8, 1.2]), torch.tensor([1.0, 0.5, 2.0]))
    torch.testing.assert_close(r, torch.tensor([0.5, 0.4, -0.1]))      # gain / distance
    torch.testing.assert_close(w, torch.tensor([5 / 9, 4 / 9, 0.0]))   # positive ones, normalised
    w, r = fomo_weights(own, torch.tensor([1.5, 2.0]), torch.tensor([1.0, 3.0]))
    assert torch.equal(w, torch.zeros(2)) and (r < 0).all()
    w, _ = fomo_weights(own, torch.tensor([0.5, 0.5]), torch.tensor([0.0, 2.0]))  # a model at distance 0 gets 0
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0]))


def test_all_negative_gains_leave_the_model_unchanged():
    loss = lambda w, x, y: ((x @ w - y) ** 2).mean()
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, 2.0])
    own = torch.tensor([1.0, 2.0])                                     # the optimum: every other model is worse
    models = torch.tensor([[0.0, 0.0], [3.0, 1.0], [1.0, 2.5]])
    new, r = FedFomoClient().federated_update(loss, own, models, [0, 1, 2], x, y)
    assert torch.equal(new, own) and (r < 0).all()
    # one better model among worse ones: θ_i moves all the way to it (its weight is 1)
    new, _ = FedFomoClient().federated_update(loss, torch.tensor([0.0, 0.0]), models, [1, 2], x, y)
    torch.testing.assert_close(new, models[2])


def test_choose_models_is_greedy_on_affinity_without_exploration():
    aff = np.array([0.0, 5.0, -1.0, 3.0, 2.0])
    assert choose_models([0, 2, 3], aff, 5, 0.3, np.random.default_rng(0)) == [0, 2, 3]
    assert choose_models([0, 1, 2, 3, 4], aff, 2, 0.0, np.random.default_rng(0)) == [1, 3]
    picks = choose_models([0, 1, 2, 3, 4], aff, 3, 1.0, np.random.default_rng(1))
    assert len(set(picks)) == 3


def _split(n, k, frac=0.2, seed=0):
    perm = rng(seed, FOMO_VAL, k).permutation(n)
    nv = min(max(1, int(round(frac * n))), n - 1)
    return np.sort(perm[:nv]), np.sort(perm[nv:])


def test_fedfomo_two_rounds_equal_a_hand_loop(digits_fed):
    """Round 1: clients 1, 4, 6 train from θ₀ (no model uploaded yet). Round 2: clients 1 and 2 download
    the uploaded models of the others, weight them by validation-loss gain per L1 distance, move, train."""
    rounds = [[1, 4, 6], [1, 2]]
    m = fl.get_method("fedfomo", n_models=3, epsilon=0.0)
    h = fl.simulate(m, digits_fed, rounds=2, clients_per_round=only(*rounds), lr=LR, progress=False, **MLP16)
    net = build_model("mlp", digits_fed, 0, {"hidden": (16,)})
    loss, w0 = make_loss(net), flatten_params(net)
    K = digits_fed.num_clients
    table, uploaded, own = w0.repeat(K, 1), set(), {k: w0.clone() for k in range(K)}
    aff = torch.zeros(K, K)

    def train(k, w, r):
        x, y = digits_fed.client_train[k]
        _, ti = _split(len(y), k)
        for idx in batch_schedule(len(ti), 32, 1, None, rng(0, BATCHES, r, k)):
            rows = ti[idx]
            w = w - LR * torch.func.grad(loss)(w, x[rows], y[rows])
        return w

    for r, ids in enumerate(rounds):
        new = {}
        for k in ids:
            w = own[k]
            others = sorted(n for n in uploaded if n != k)
            if others:
                x, y = digits_fed.client_train[k]
                vi, _ = _split(len(y), k)
                base = F.cross_entropy(load_flat(net, w)(x[vi]), y[vi]).item()
                gains = []
                for n in others:
                    ln = F.cross_entropy(load_flat(net, table[n])(x[vi]), y[vi]).item()
                    gains.append((base - ln) / float((table[n] - w).abs().sum()))
                pos = [max(gn, 0.0) for gn in gains]
                if sum(pos) > 0:
                    w = w + sum(p / sum(pos) * (table[n] - w) for p, n in zip(pos, others))
                for gn, n in zip(gains, others):
                    aff[k, n] += gn / max(abs(sum(gains)), 1e-9)
            new[k] = train(k, w, r)
        for k in ids:
            own[k] = table[k] = new[k]
            uploaded.add(k)
    store = h.store.all("cpu")["model"]
    for k in {1, 2, 4, 6}:
        torch.testing.assert_close(store[k], own[k], atol=1e-5, rtol=1e-4)
    assert torch.equal(store[0], w0)                                   # never sampled: θ₀
    torch.testing.assert_close(h.state["objective"]["models"], table, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h.state["objective"]["affinity"], aff, atol=1e-5, rtol=1e-4)
    assert not torch.equal(aff[2], torch.zeros(K))
    sizes = torch.tensor([float(len(digits_fed.client_train[k][1])) for k in rounds[1]])
    torch.testing.assert_close(h.theta, (sizes / sizes.sum()) @ torch.stack([own[k] for k in rounds[1]]),
                               atol=1e-5, rtol=1e-4)
    # personal model = the client's own stored model, on its own test split
    mine = [fl.engine.evaluate(h.model, store[c], *digits_fed.client_test[c])[1] for c in h.client_acc["client"]]
    np.testing.assert_allclose(h.client_acc["personal model"], mine)
    assert (h["bytes_up"] == [3 * (w0.numel() + K) * 4, 2 * (w0.numel() + K) * 4]).all()


def test_fedfomo_loop_equals_vmap(digits_fed):
    run = dict(rounds=3, clients_per_round=4, lr=LR, progress=False, **MLP16)
    a = fl.simulate(fl.get_method("fedfomo", n_models=2), digits_fed, backend="loop", **run)
    b = fl.simulate(fl.get_method("fedfomo", n_models=2), digits_fed, backend="vmap", **run)
    torch.testing.assert_close(a.store.all("cpu")["model"], b.store.all("cpu")["model"], atol=1e-5, rtol=1e-4)
