"""Personal-head and personalisation baselines (issue 11): Local-only, FedAvg-FT, FedPer, LG-FedAvg, FedRep,
FedBABU, FedBN — each against a hand-written reference on a tiny problem, loop = vmap, and exact resume."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.engine.client import make_loss, train_clients_loop
from fedlab_nb.engine.server import RoundSetup, RunConfig, build_model, local_context, local_job
from fedlab_nb.methods.personalisation.fedavg_ft import FINETUNE
from fedlab_nb.methods.heads import BODY, HEAD, HeadSplit
from fedlab_nb.models import buffer_spec, flatten_buffers, flatten_params, load_flat, make_model, param_spec
from fedlab_nb.utils import rng

PY = sys.executable
LR = 0.1
MLP16 = dict(model="mlp", model_kwargs={"hidden": (16,)})


def only(*ids):
    return lambda r, K, g: np.array(ids)


def theta0(fed, model="mlp", kwargs=None):
    return flatten_params(build_model(model, fed, 0, kwargs if kwargs is not None else {"hidden": (16,)}))


def sgd(loss, w, job, lr=LR, trained=None):
    """Plain SGD on the flat w along job's batches; only the `trained` mask moves (all when None)."""
    for idx in job.batches:
        g = torch.func.grad(loss)(w, job.x[idx], job.y[idx])
        w = w - lr * (g if trained is None else g * trained)
    return w


def masks(fed, groups, model="mlp"):
    spec = param_spec(build_model(model, fed, 0, {"hidden": (16,)}))
    return groups.resolve(spec)


# --- the head split --------------------------------------------------------------------------------------
def test_default_head_is_the_last_layer_and_bad_patterns_name_the_parameters():
    spec = lambda name, **kw: param_spec(make_model(name, (1, 8, 8), 10, **kw))
    assert HeadSplit(local=(HEAD,)).resolve(spec("mlp", hidden=(16, 8))).local == {"body.4.weight", "body.4.bias"}
    assert HeadSplit(local=(HEAD,)).resolve(spec("cnn")).local == {"head.3.weight", "head.3.bias"}
    assert HeadSplit(local=(HEAD,)).resolve(spec("mlp_bn", hidden=(16,))).local == {"head.weight", "head.bias"}
    body = HeadSplit(local=(BODY,)).resolve(spec("mlp", hidden=(16,)))
    assert body.local == {"body.0.weight", "body.0.bias"} and body.sent == {"body.2.weight", "body.2.bias"}
    with pytest.raises(ValueError, match=r"head pattern 'classifier\.\*' matches no parameter.*body\.0\.weight"):
        HeadSplit(local=(HEAD,), head=("classifier.*",)).resolve(spec("mlp", hidden=(16,)))
    with pytest.raises(ValueError, match="matches no parameter"):
        fl.simulate(fl.get_method("fedper", head="nothing.*"), fl.federate("digits", "iid", n_clients=2), rounds=1,
                    progress=False)


# --- FedPer and LG-FedAvg: the kept part never reaches the server ----------------------------------------
@pytest.mark.parametrize("name,kept", [("fedper", HEAD), ("lg_fedavg", BODY)])
def test_kept_part_untouched_by_aggregation_and_equal_to_a_hand_loop(digits_fed, name, kept):
    """One client, one round: local SGD on the whole model by hand; the server moves only the shared part
    (to the client's weights), keeps the other part at θ₀ bit for bit, and the client stores its part."""
    h = fl.simulate(name, digits_fed, rounds=1, clients_per_round=only(3), lr=LR, progress=False, **MLP16)
    g = masks(digits_fed, HeadSplit(local=(kept,)))
    local, sent = g.mask("local"), g.mask("sent")
    w0 = theta0(digits_fed)
    w = sgd(make_loss(h.model), w0.clone(), local_job(digits_fed, 3, RunConfig(lr=LR), 0, None))
    assert torch.equal(h.theta[local], w0[local])
    torch.testing.assert_close(h.theta[sent], w[sent])
    torch.testing.assert_close(h.store.all("cpu")["local"][3], w[local])
    assert h["bytes_up"].iloc[0] == int(sent.sum()) * 4


def test_fedper_head_stays_theta0_on_the_server_over_rounds(digits_fed):
    h = fl.simulate("fedper", digits_fed, rounds=3, clients_per_round=4, lr=LR, progress=False, **MLP16)
    g = masks(digits_fed, HeadSplit(local=(HEAD,)))
    w0 = theta0(digits_fed)
    assert torch.equal(h.theta[g.mask("local")], w0[g.mask("local")])
    assert not torch.equal(h.theta[g.mask("sent")], w0[g.mask("sent")])
    heads, trained = h.store.all("cpu")["local"], h.store.written.numpy()
    assert trained.any() and all(not torch.equal(heads[k], w0[g.mask("local")]) for k in np.flatnonzero(trained))


# --- Local-only ---------------------------------------------------------------------------------------------
def test_local_only_sends_nothing_and_continues_its_own_model(digits_fed):
    h = fl.simulate("local_only", digits_fed, rounds=2, clients_per_round=only(2, 5), lr=LR, progress=False, **MLP16)
    w0 = theta0(digits_fed)
    assert (h["bytes_up"] == 0).all()
    assert torch.equal(h.theta, w0)  # the server step is a no-op
    loss = make_loss(h.model)
    for k in (2, 5):  # round 1 from θ₀, round 2 from its own round-1 model
        w = w0.clone()
        for r in range(2):
            w = sgd(loss, w, local_job(digits_fed, k, RunConfig(lr=LR), r, None))
        torch.testing.assert_close(h.store.all("cpu")["local"][k], w)
    # personal accuracy = each client's own model on its own test split
    mine = [fl.engine.evaluate(h.model, h.store.all("cpu")["local"][k], *digits_fed.client_test[k])[1]
            for k in h.client_acc["client"]]
    np.testing.assert_allclose(h.client_acc["personal model"], mine)


# --- FedAvg-FT: evaluation-time fine-tuning ------------------------------------------------------------------
def _hand_finetune(model, theta, fed, rnd, steps, batch_size=32, seed=0, trained=None):
    from fedlab_nb.core.round import LocalJob, batch_schedule
    loss, out = make_loss(model), []
    for k in range(fed.num_clients):
        x, y = fed.client_train[k]
        job = LocalJob(k, x, y, batch_schedule(len(y), batch_size, 1, steps, rng(seed, FINETUNE, rnd, k)))
        out.append(sgd(loss, theta.clone(), job, trained=trained))
    return torch.stack(out)


def test_fedavg_ft_personal_models_equal_a_hand_loop(digits_fed):
    k = 4
    method = fl.get_method("fedavg_ft", steps=k)
    h = fl.simulate(method, digits_fed, rounds=2, clients_per_round=3, lr=LR, progress=False, **MLP16)
    ref = _hand_finetune(h.model, h.theta, digits_fed, 1, k)
    model = h.model
    groups = method.groups.resolve(param_spec(model))
    for kernel in (train_clients_loop, fl.engine.batched.train_clients_vmap):
        setup = RoundSetup(method, digits_fed, RunConfig(lr=LR), make_loss(model), groups, kernel)
        W = method.client.personal_at_evaluation(method, h.theta, {}, local_context(setup, 1), {"theta": h.theta})
        torch.testing.assert_close(W, ref, atol=1e-5, rtol=1e-4)
    mine = [fl.engine.evaluate(model, ref[c], *digits_fed.client_test[c])[1] for c in h.client_acc["client"]]
    np.testing.assert_allclose(h.client_acc["personal model"], mine)
    # fine-tuning leaves the global model alone: FedAvg with the same seed ends at the same θ
    torch.testing.assert_close(fl.simulate("fedavg", digits_fed, rounds=2, clients_per_round=3, lr=LR, progress=False,
                                           **MLP16).theta, h.theta)


# --- FedBABU: frozen head during training, fine-tuned at evaluation -------------------------------------------
def test_fedbabu_head_frozen_bit_identical_and_fine_tuned_at_evaluation(digits_fed):
    h = fl.simulate(fl.get_method("fedbabu", epochs=None, steps=3), digits_fed, rounds=2, clients_per_round=4, lr=LR,
                    progress=False, **MLP16)
    g = masks(digits_fed, HeadSplit(frozen=(HEAD,)))
    head, w0 = ~g.mask("trained"), theta0(digits_fed)
    assert torch.equal(h.theta[head], w0[head])                 # never trained, never sent
    assert not torch.equal(h.theta[~head], w0[~head])
    assert (h["bytes_up"] == 4 * int(g.mask("sent").sum()) * 4).all()
    ref = _hand_finetune(h.model, h.theta, digits_fed, 1, 3)   # the full model is fine-tuned, head included
    assert not torch.equal(ref[:, head], w0[head].expand(len(ref), -1))
    mine = [fl.engine.evaluate(h.model, ref[c], *digits_fed.client_test[c])[1] for c in h.client_acc["client"]]
    np.testing.assert_allclose(h.client_acc["personal model"], mine)


# --- FedRep: head epochs, then body epochs --------------------------------------------------------------------
def test_fedrep_head_phase_then_body_phase_equals_a_hand_loop(digits_fed):
    m = fl.get_method("fedrep", head_epochs=2, body_epochs=1)
    h = fl.simulate(m, digits_fed, rounds=1, clients_per_round=only(3), lr=LR, progress=False, **MLP16)
    g = masks(digits_fed, HeadSplit(local=(HEAD,)))
    head, body = g.mask("local").float(), g.mask("sent").float()
    cfg, w0, loss = RunConfig(lr=LR), theta0(digits_fed), make_loss(h.model)
    head_job = local_job(digits_fed, 3, cfg, 0, None, None, 0, 2)    # track 0, 2 epochs
    body_job = local_job(digits_fed, 3, cfg, 0, None, None, 1, 1)    # track 1, 1 epoch
    w_head = sgd(loss, w0.clone(), head_job, trained=head)
    assert torch.equal(w_head[g.mask("sent")], w0[g.mask("sent")])   # body frozen in the head phase: bit-identical
    w = sgd(loss, w_head, body_job, trained=body)
    assert torch.equal(w[g.mask("local")], w_head[g.mask("local")])  # head frozen in the body phase
    torch.testing.assert_close(h.store.all("cpu")["local"][3], w[g.mask("local")])
    torch.testing.assert_close(h.theta[g.mask("sent")], w[g.mask("sent")])
    assert torch.equal(h.theta[g.mask("local")], w0[g.mask("local")])
    # the other order gives another model: the phase order is what the test pins down
    swapped = sgd(loss, sgd(loss, w0.clone(), head_job, trained=body), body_job, trained=head)
    assert not torch.allclose(swapped[g.mask("sent")], w[g.mask("sent")], atol=1e-4)


# --- loop = vmap ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kw", [("local_only", {}), ("fedper", {}), ("lg_fedavg", {}), ("fedavg_ft", {"steps": 3}),
                                     ("fedbabu", {"epochs": 1}), ("fedrep", {"head_epochs": 2, "body_epochs": 1})])
def test_loop_equals_vmap(digits_fed, name, kw):
    run = dict(rounds=2, clients_per_round=4, lr=LR, progress=False, stragglers=0.5, **MLP16)
    a = fl.simulate(fl.get_method(name, **kw), digits_fed, backend="loop", **run)
    b = fl.simulate(fl.get_method(name, **kw), digits_fed, backend="vmap", **run)
    assert a.meta["backend_used"] == "loop" and b.meta["backend_used"] == "vmap"
    torch.testing.assert_close(a.theta, b.theta, atol=1e-5, rtol=1e-4)
    cols = [c for c in a.columns if c.endswith(("acc_mean", "test_acc"))]
    assert "personal_acc_mean" in cols
    np.testing.assert_allclose(a[cols].to_numpy(float), b[cols].to_numpy(float), atol=1e-6)


# --- FedBN: BatchNorm parameters and running statistics stay local ---------------------------------------------
def _torch_reference(model, theta, buffers, job, lr=LR):
    """The same local SGD on an nn.Module in training mode with torch.optim (BN updates its statistics)."""
    ref = make_model("mlp_bn", (64,), 10, hidden=(16,))
    load_flat(ref, theta)
    fl.models.load_buffers(ref, buffers)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for idx in job.batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(job.x[idx]), job.y[idx]).backward()
        opt.step()
    return flatten_params(ref), flatten_buffers(ref), ref


def test_fedbn_keeps_bn_parameters_and_statistics_local(digits_fed):
    kw = dict(model="mlp_bn", model_kwargs={"hidden": (16,)}, lr=LR, progress=False)
    h = fl.simulate("fedbn", digits_fed, rounds=1, clients_per_round=only(3), **kw)
    assert h.meta["backend_used"] == "loop"
    model0 = build_model("mlp_bn", digits_fed, 0, {"hidden": (16,)})
    w0, b0 = flatten_params(model0), flatten_buffers(model0)
    g = fl.get_method("fedbn").groups.resolve(param_spec(model0))
    assert g.local == {"body.bn0.weight", "body.bn0.bias"}
    bn = g.mask("local")
    w, b, ref = _torch_reference(model0, w0, b0, local_job(digits_fed, 3, RunConfig(lr=LR), 0, None))
    store = h.store.all("cpu")
    assert torch.equal(h.theta[bn], w0[bn])                         # the server never sees γ, β
    torch.testing.assert_close(h.theta[~bn], w[~bn])
    torch.testing.assert_close(store["local"][3], w[bn])
    torch.testing.assert_close(store["buffers"][3], b)              # the client's own running statistics
    assert torch.equal(store["buffers"][0], b0)                     # a client that never trained: the initial ones
    assert torch.equal(flatten_buffers(h.model), b0)                # the global statistics never move under FedBN
    # client 3's personal model is scored with its own γ, β and statistics, in eval mode
    ref.eval()
    load_flat(ref, torch.where(bn, torch.zeros_like(w).index_put_((bn.nonzero().ravel(),), store["local"][3]), h.theta))
    with torch.no_grad():
        x, y = digits_fed.client_test[3]
        acc = float((ref(x).argmax(1) == y).float().mean())
    assert h.client_acc["personal model"][list(h.client_acc["client"]).index(3)] == pytest.approx(acc)


def test_fedavg_on_a_bn_model_averages_the_running_statistics(digits_fed):
    kw = dict(model="mlp_bn", model_kwargs={"hidden": (16,)}, lr=LR, progress=False)
    h = fl.simulate("fedavg", digits_fed, rounds=1, clients_per_round=only(2, 6), backend="vmap", **kw)
    assert h.meta["backend_used"] == "loop"  # BatchNorm cannot be vmapped: the engine falls back
    model0 = build_model("mlp_bn", digits_fed, 0, {"hidden": (16,)})
    w0, b0 = flatten_params(model0), flatten_buffers(model0)
    refs = [_torch_reference(model0, w0, b0, local_job(digits_fed, k, RunConfig(lr=LR), 0, None)) for k in (2, 6)]
    n = torch.tensor([float(len(digits_fed.client_train[k][1])) for k in (2, 6)])
    p = n / n.sum()
    torch.testing.assert_close(h.theta, p[0] * refs[0][0] + p[1] * refs[1][0])
    mean = p[0] * refs[0][1] + p[1] * refs[1][1]
    got, names = flatten_buffers(h.model), [s[0] for s in buffer_spec(h.model)]
    count = [i for i, nm in enumerate(names) if nm.endswith("num_batches_tracked")]
    keep = torch.ones_like(got, dtype=torch.bool)
    keep[[sum(s[1].numel() for s in buffer_spec(h.model)[:i]) for i in count]] = False
    torch.testing.assert_close(got[keep], mean[keep])


def test_fedbn_needs_a_model_with_batchnorm(digits_fed):
    with pytest.raises(ValueError, match=r"pattern '\*bn\*' matches no parameter; the model has body.0.weight"):
        fl.simulate("fedbn", digits_fed, rounds=1, progress=False, **MLP16)


# --- kill and resume in a new process ---------------------------------------------------------------------------
RUN = textwrap.dedent("""
    import os, sys, fedlab_nb as fl
    fed = fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0, min_size=20)
    def die(r, theta, row):
        if r == int(os.environ.get("DIE_AT", "0")):
            os._exit(9)  # a kill: no clean-up, no History
    method = fl.get_method(sys.argv[3], **({"head_epochs": 2, "body_epochs": 1} if sys.argv[3] == "fedrep" else {}))
    h = fl.simulate(method, fed, model=sys.argv[4], model_kwargs={"hidden": (16,)}, rounds=4, clients_per_round=3,
                    lr=0.1, progress=False, checkpoint=sys.argv[1], resume=True, callback=die)
    h.save(sys.argv[2])
""")


@pytest.mark.parametrize("name,model", [("fedrep", "mlp"), ("fedbn", "mlp_bn"), ("fedavg", "mlp_bn")])
def test_kill_and_resume_in_a_new_process(tmp_path, name, model):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda tag, **e: subprocess.run([PY, script, tmp_path / f"{tag}.pt", tmp_path / f"{tag}.csv", name, model],
                                          env={**env, **e}, capture_output=True, text=True)
    full = run("a")
    assert full.returncode == 0, full.stderr[-2000:]
    assert run("b", DIE_AT="2").returncode == 9 and not (tmp_path / "b.csv").exists()
    resumed = run("b")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = pd.read_csv(tmp_path / "a.csv"), pd.read_csv(tmp_path / "b.csv")
    assert ("personal_acc_mean" in a.columns) == (name != "fedavg")
    pd.testing.assert_frame_equal(a, b)  # fedavg + BN: the global running statistics are checkpointed too
