"""The loop backend trains the module eagerly (`engine.client._train_eager`, issue 43 item 2) and must give the bits
of the flat `torch.func` loop it replaced and of a hand-written torch loop: these tests compare with torch.equal."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb.core.groups import ParamGroups
from fedlab_nb.core.method import LocalObjective
from fedlab_nb.core.optim import SGD, Adam
from fedlab_nb.engine import client
from fedlab_nb.engine.client import LocalJob, batch_schedule, make_loss, train_clients_loop
from fedlab_nb.methods.heterogeneity.fedprox import ProximalObjective
from fedlab_nb.models import flatten_buffers, flatten_params, make_model, param_spec


def _jobs(x, y, m=4, batch=10, seed=0, ctx=None):
    """m clients of unequal sizes cut from (x, y), each with a one-epoch schedule (the last batch smaller)."""
    g, jobs, at = np.random.default_rng(seed), [], 0
    for k in range(m):
        n = 23 + 7 * k
        xs, ys = x[at:at + n], y[at:at + n]
        jobs.append(LocalJob(k, xs, ys, batch_schedule(n, batch, 1, None, g), None if ctx is None else ctx[k]))
        at += n
    return jobs


def _data(shape=(64,), n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def _flat(loss_fn):
    """The same loss as a plain function of (θ, x, y): not a ModelLoss, so the kernel takes the flat torch.func path."""
    def loss(w, x, y, **kw):
        return loss_fn(w, x, y, **kw)
    loss.buffer_spec = loss_fn.buffer_spec   # what the flat loop reads for a model with buffers
    return loss


def test_loop_equals_a_hand_written_torch_loop_for_fedavg():
    torch.manual_seed(0)
    model = make_model("mlp", (64,), 10)
    theta = flatten_params(model)
    x, y = _data()
    jobs, lr = _jobs(x, y), 0.05
    W, losses = train_clients_loop(make_loss(model), theta, jobs, lr, LocalObjective(), weights=True)
    for i, job in enumerate(jobs):   # pfl-research's way: one module, autograd, in-place SGD
        net = make_model("mlp", (64,), 10)
        net.load_state_dict(model.state_dict())
        total = torch.zeros(())
        for idx in job.batches:
            idx = torch.as_tensor(idx)
            loss = F.cross_entropy(net(job.x[idx]), job.y[idx])
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= lr * p.grad
                    p.grad = None
            total += loss.detach()
        assert torch.equal(W[i], flatten_params(net)), f"client {i}"
        assert torch.equal(losses[i], total / len(job.batches))


@pytest.mark.parametrize("case", ["plain", "delta", "prox", "momentum", "adam", "groups", "start", "steps"])
def test_eager_loop_equals_the_flat_loop_bit_for_bit(case):
    torch.manual_seed(1)
    model = make_model("mlp", (64,), 10)
    theta = flatten_params(model)
    x, y = _data()
    jobs, kw, obj = _jobs(x, y), {}, LocalObjective()
    if case == "prox":
        obj = ProximalObjective(0.3)
    elif case == "momentum":
        kw["optimizer"] = SGD(momentum=0.9, weight_decay=1e-3, nesterov=True)
    elif case == "adam":
        kw["optimizer"] = Adam(lr=1e-3, weight_decay=0.01, decoupled=True)
    elif case == "groups":   # only the last layer trains (segments of the flat vector)
        last = [n for n, _ in param_spec(model)][-2:]
        kw["groups"] = ParamGroups(frozen=tuple(n for n, _ in param_spec(model) if n not in last)).resolve(param_spec(model))
    elif case == "start":
        kw["start"] = theta + 0.01 * torch.randn(len(jobs), theta.numel())
    elif case == "steps":   # many more steps than a pass: batches cycle over permutations
        g = np.random.default_rng(3)
        jobs = [LocalJob(j.client_id, j.x, j.y, batch_schedule(len(j.y), 8, 1, 17, g)) for j in jobs]
    weights = case != "delta"
    eager = train_clients_loop(make_loss(model), theta, jobs, 0.05, obj, weights=weights, **kw)
    flat = train_clients_loop(_flat(make_loss(model)), theta, jobs, 0.05, obj, weights=weights, **kw)
    assert not torch.equal(eager[0], theta.expand_as(eager[0])) if weights else eager[0].abs().sum() > 0
    assert torch.equal(eager[0], flat[0]) and torch.equal(eager[1], flat[1])


def test_eager_loop_equals_the_flat_loop_with_batchnorm_buffers_cnn_and_float64():
    torch.manual_seed(2)
    model = make_model("cnn_bn", (1, 8, 8), 10)
    theta = flatten_params(model)
    x, y = _data((64,))
    jobs = _jobs(x, y)
    bufs = flatten_buffers(model).repeat(len(jobs), 1)
    b_eager, b_flat = bufs.clone(), bufs.clone()
    eager = train_clients_loop(make_loss(model), theta, jobs, 0.05, LocalObjective(), buffers=b_eager)
    flat = train_clients_loop(_flat(make_loss(model)), theta, jobs, 0.05, LocalObjective(), buffers=b_flat)
    assert torch.equal(eager[0], flat[0]) and torch.equal(eager[1], flat[1])
    assert torch.equal(b_eager, b_flat) and not torch.equal(b_eager, bufs)   # the statistics moved, the same way
    assert torch.equal(flatten_buffers(model), bufs[0])                      # the model's own are untouched

    double = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)).double()
    jobs = _jobs(x.double(), y)
    theta = flatten_params(double)
    eager = train_clients_loop(make_loss(double), theta, jobs, 0.05, ProximalObjective(0.1))
    flat = train_clients_loop(_flat(make_loss(double)), theta, jobs, 0.05, ProximalObjective(0.1))
    assert eager[0].dtype == torch.float64 and torch.equal(eager[0], flat[0]) and torch.equal(eager[1], flat[1])


def test_model_loss_takes_the_eager_path_and_any_other_loss_the_flat_one(monkeypatch):
    torch.manual_seed(0)
    model = make_model("mlp", (64,), 10)
    x, y = _data()
    monkeypatch.setattr(client, "grad_and_value", lambda *a, **k: pytest.fail("the flat torch.func path ran"))
    train_clients_loop(make_loss(model), flatten_params(model), _jobs(x, y), 0.05, LocalObjective())
    with pytest.raises(pytest.fail.Exception, match="flat torch.func path"):
        train_clients_loop(_flat(make_loss(model)), flatten_params(model), _jobs(x, y), 0.05, LocalObjective())


def test_the_module_keeps_its_own_parameters_also_after_an_error():
    torch.manual_seed(0)
    model = make_model("mlp", (64,), 10)
    before = {n: p for n, p in model.named_parameters()}
    theta = flatten_params(model)
    x, y = _data()
    train_clients_loop(make_loss(model), theta + 1, _jobs(x, y), 0.05, LocalObjective())
    assert {n: p for n, p in model.named_parameters()} == before and torch.equal(flatten_params(model), theta)
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())

    class Broken(LocalObjective):
        def correction(self, w, anchor, ctx):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        train_clients_loop(make_loss(model), theta, _jobs(x, y), 0.05, Broken())
    assert {n: p for n, p in model.named_parameters()} == before and torch.equal(flatten_params(model), theta)


def test_tied_and_unused_parameters_as_the_flat_loop():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(10, 10)
            self.b = torch.nn.Linear(10, 10)
            self.b.weight = self.a.weight          # tied: one parameter in two places
            self.unused = torch.nn.Linear(3, 3)    # never in the forward: its gradient is 0

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Tied()
    theta = flatten_params(model)
    x, y = _data((10,))
    eager = train_clients_loop(make_loss(model), theta, _jobs(x, y), 0.05, LocalObjective(), weights=True)
    flat = train_clients_loop(_flat(make_loss(model)), theta, _jobs(x, y), 0.05, LocalObjective(), weights=True)
    assert torch.equal(eager[0], flat[0]) and torch.equal(eager[1], flat[1])
    n_unused = sum(p.numel() for p in model.unused.parameters())
    assert torch.equal(eager[0][:, -n_unused:], theta[-n_unused:].expand(len(eager[0]), -1))
    assert model.b.weight is model.a.weight


def test_simulate_loop_results_unchanged_by_the_eager_path(digits_fed, monkeypatch):
    """A whole run (FedProx: a correction; stragglers) equals the same run with the flat loop forced."""
    kw = dict(model="mlp", rounds=2, clients_per_round=4, batch_size=16, progress=False, backend="loop",
              stragglers=0.3, seed=3)
    eager = fl.simulate("fedprox", digits_fed, **kw)
    from fedlab_nb.engine import server
    monkeypatch.setattr(server, "make_loss", lambda model, loss=None: _flat(make_loss(model, loss)))   # the flat path
    flat = fl.simulate("fedprox", digits_fed, **kw)
    assert torch.equal(eager.theta, flat.theta)
    assert eager[["train_loss", "test_loss", "test_acc"]].equals(flat[["train_loss", "test_loss", "test_acc"]])
