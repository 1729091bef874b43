"""The round pipeline: layers, registry, client optimisers, parameter groups, the client store, messages
and bytes, personal-model evaluation, and exact resume in a new process."""
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core import SGD, Adam, Method, ParamGroups, encode
from fedlab_nb.core.registry import REGISTRY
from fedlab_nb.core.streams import register_stream
from fedlab_nb.engine.batched import train_clients_fused, train_clients_vmap
from fedlab_nb.engine.client import LocalJob, batch_schedule, make_loss, train_clients_loop
from fedlab_nb.methods import LocalObjective
from fedlab_nb.models import MLP, flatten_params, param_spec, unflatten

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def test_engine_imports_no_method():
    code = "import sys, fedlab_nb.engine; print([m for m in sys.modules if m.startswith('fedlab_nb.methods')])"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_engine_does_not_resolve_names(digits_fed):
    from fedlab_nb.engine import simulate
    with pytest.raises(TypeError, match="fedlab_nb.simulate"):
        simulate("fedavg", digits_fed, rounds=1)


def test_stream_ids_are_unique():
    with pytest.raises(ValueError, match="already used"):
        register_stream("my_new_purpose", 2)  # 2 = the batch order
    assert register_stream("batches", 2) == 2  # re-registering the same pair is fine


# --- registry ---------------------------------------------------------------------------------------
def test_every_claims_file_has_a_registered_method_and_back():
    pytest.importorskip("flwr")
    import fedlab_nb.flower  # noqa: F401  (registers the Flower adapter)
    import fedlab_nb.methods  # noqa: F401
    import fedlab_nb.methods.privacy  # noqa: F401
    import fedlab_nb.methods.bilevel  # noqa: F401
    import fedlab_nb.methods.beyond  # noqa: F401
    import fedlab_nb.data  # noqa: F401
    claims = {p.stem for p in (ROOT / "papers").glob("*.yaml")}
    registered = {e.claims for e in REGISTRY.values() if e.claims}
    assert claims - registered == set(), "claims files whose method/module is not registered"
    for e in REGISTRY.values():
        if e.claims:
            assert (ROOT / "papers" / f"{e.claims}.yaml").exists(), f"{e.key}: no papers/{e.claims}.yaml"
            assert (ROOT / "notebooks" / f"{e.notebook}.ipynb").exists(), f"{e.key}: no notebooks/{e.notebook}.ipynb"


def test_get_method_by_name_and_errors():
    assert fl.get_method("ditto", lam=0.5).client.lam == 0.5
    with pytest.raises(ValueError, match="did you mean 'fedprox'"):
        fl.get_method("fedprx")
    with pytest.raises(ValueError, match="registered as a module"):
        fl.get_method("afl")


# --- client optimisers against torch.optim ------------------------------------------------------------
def _jobs(model, n_clients=3, seed=0, batch=5, epochs=2):
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for k in range(n_clients):
        n = 12 + 3 * k
        x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        jobs.append(LocalJob(k, x, y, batch_schedule(n, batch, epochs, None, np.random.default_rng(k))))
    return jobs


def _torch_optim_reference(model, theta, job, make_opt):
    """The same local training written with torch.optim on an nn.Module."""
    ref = MLP(6, 3, hidden=(4,))
    with torch.no_grad():
        for p, v in zip(ref.parameters(), unflatten(theta, param_spec(ref)).values()):
            p.copy_(v)
    opt = make_opt(ref.parameters())
    for idx in job.batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(job.x[idx]), job.y[idx]).backward()
        opt.step()
    return flatten_params(ref)


OPTIMIZERS = [
    (SGD(momentum=0.9, weight_decay=1e-2), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2)),
    (SGD(momentum=0.5, nesterov=True), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, nesterov=True)),
    (Adam(), lambda p: torch.optim.Adam(p, lr=0.1)),
    (Adam(weight_decay=0.1, decoupled=True), lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1)),
]


@pytest.mark.parametrize("ours,theirs", OPTIMIZERS)
@pytest.mark.parametrize("kernel", [train_clients_loop, train_clients_vmap, train_clients_fused])
def test_client_optimizers_equal_torch_optim(ours, theirs, kernel):
    torch.manual_seed(0)
    model = MLP(6, 3, hidden=(4,))
    theta = flatten_params(model)
    jobs = _jobs(model)
    W, _ = kernel(make_loss(model), theta, jobs, 0.1, LocalObjective(), optimizer=ours, weights=True)
    for i, job in enumerate(jobs):
        torch.testing.assert_close(W[i], _torch_optim_reference(model, theta, job, theirs), atol=1e-5, rtol=1e-5)


# --- parameter groups -----------------------------------------------------------------------------------
def test_frozen_and_local_tensors(digits_fed):
    """Frozen tensors never move (bit-identical); kept-local ones move on the client, are stored, and are
    never sent: the server's copy of them stays at θ₀ and bytes_up counts only the sent tensors."""
    groups = ParamGroups(local=["body.2.*"], frozen=["body.0.bias"])
    method = Method("fedper-like", groups=groups)
    kw = dict(model="mlp", model_kwargs={"hidden": (16,)}, rounds=3, clients_per_round=4, lr=0.1, progress=False)
    h = fl.simulate(method, digits_fed, **kw)
    spec = param_spec(h.model)
    theta0 = flatten_params(fl.engine.server.build_model("mlp", digits_fed, 0, {"hidden": (16,)}))  # same seed: θ₀
    new, old = unflatten(h.theta, spec), unflatten(theta0, spec)
    assert torch.equal(new["body.0.bias"], old["body.0.bias"])          # frozen: bit-identical
    assert torch.equal(new["body.2.weight"], old["body.2.weight"])      # local: the server never sees it
    assert not torch.equal(new["body.0.weight"], old["body.0.weight"])  # shared: trained and averaged
    local, trained = h.store.all("cpu")["local"], h.store.written
    start = theta0[groups.resolve(spec).index("local")]
    assert trained.any() and all(not torch.equal(local[k], start) for k in np.flatnonzero(trained.numpy()))
    assert all(torch.equal(local[k], start) for k in np.flatnonzero(~trained.numpy()))  # untouched clients
    sent = groups.resolve(spec).index("sent")
    assert h["bytes_up"].iloc[0] == 4 * len(sent) * 4  # 4 clients × d_sent float32
    assert "personal_acc_mean" in h.columns


def test_frozen_tensor_bit_identical_on_the_client():
    torch.manual_seed(0)
    model = MLP(6, 3, hidden=(4,))
    theta, jobs = flatten_params(model), _jobs(model)
    groups = ParamGroups(frozen=["body.0.*"]).resolve(param_spec(model))
    for kernel, optimizer in itertools.product((train_clients_loop, train_clients_vmap, train_clients_fused),
                                               (SGD(momentum=0.9), None)):
        W, _ = kernel(make_loss(model), theta, jobs, 0.1, LocalObjective(), groups=groups, weights=True,
                      optimizer=optimizer)
        frozen = ~groups.mask("trained")
        assert torch.equal(W[:, frozen], theta[frozen].expand(len(jobs), -1))
        assert not torch.equal(W[:, ~frozen], theta[~frozen].expand(len(jobs), -1))


def test_unknown_group_pattern_names_the_parameters():
    with pytest.raises(ValueError, match="matches no parameter.*body.0.weight"):
        ParamGroups(local=["head.*"]).resolve(param_spec(MLP(6, 3, hidden=(4,))))


# --- messages and bytes ------------------------------------------------------------------------------------
def test_bytes_up_equals_encoded_payload(digits_fed):
    seen = []
    h = fl.simulate("scaffold", digits_fed, model="logreg", rounds=2, clients_per_round=3, lr=0.1, progress=False,
                    attack=lambda u, m, generator=None: u, byzantine=[])
    d = flatten_params(h.model).numel()
    one = len(encode({"delta": torch.zeros(d), "delta_c": torch.zeros(d)}))
    assert one == 2 * d * 4
    assert (h["bytes_up"] == 3 * one).all() and (h["bytes_down"] == 3 * one).all()  # θ and c go down


# --- stateful methods: loop = vmap, state persists ------------------------------------------------------------
@pytest.mark.parametrize("method", [lambda: fl.get_method("ditto", lam=0.5),
                                    lambda: Method("adam-clients", optimizer=Adam(lr=0.01)),
                                    lambda: Method("sgdm-clients", optimizer=SGD(momentum=0.9, weight_decay=1e-3))])
def test_loop_equals_vmap_for_stateful_and_optimizer_methods(fused_steps, digits_fed, method):
    calls = fused_steps
    kw = dict(model="mlp", model_kwargs={"hidden": (16,)}, rounds=3, clients_per_round=4, lr=0.05, progress=False,
              stragglers=0.5)
    a = fl.simulate(method(), digits_fed, backend="loop", **kw)
    b = fl.simulate(method(), digits_fed, backend="vmap", **kw)
    assert a.meta["backend_used"] == "loop" and b.meta["backend_used"] == "vmap" and not calls
    c = fl.simulate(method(), digits_fed, **kw)   # "auto": the fused step, with the optimiser taking its gradients
    assert c.meta["backend_used"] == "fused" and calls
    cols = [c for c in a.columns if c.endswith(("acc_mean", "test_acc"))]
    for other in (b, c):
        torch.testing.assert_close(a.theta, other.theta, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(a[cols].to_numpy(float), other[cols].to_numpy(float), atol=1e-6)


def test_ditto_personal_models_persist_for_all_clients(digits_fed):
    h = fl.simulate("ditto", digits_fed, model="logreg", rounds=2, clients_per_round=2, lr=0.1, progress=False)
    v = h.store.all("cpu")["v"]
    theta0 = flatten_params(fl.engine.server.build_model("logreg", digits_fed, 0))
    sampled = h.store.written
    assert 0 < int(sampled.sum()) <= 4 and not sampled.all()
    assert all(torch.equal(v[k], theta0) for k in np.flatnonzero(~sampled.numpy()))   # never sampled: v⁰ = w⁰
    assert all(not torch.equal(v[k], theta0) for k in np.flatnonzero(sampled.numpy()))
    assert {"personal_acc_mean", "personal_acc_std", "personal_acc_p10"} <= set(h.columns)


def test_ditto_personal_step_matches_hand_written(digits_fed):
    """One client, one round: v ← v − η(∇F(v) + λ(v − w)) step by step, by hand, equals the engine's v."""
    from fedlab_nb.engine.server import RunConfig, local_job
    lam, lr = 0.7, 0.1
    h = fl.simulate(fl.get_method("ditto", lam=lam), digits_fed, model="logreg", rounds=1,
                    clients_per_round=lambda r, K, g: np.array([3]), lr=lr, progress=False)
    model = fl.engine.server.build_model("logreg", digits_fed, 0)
    w = flatten_params(model)
    job = local_job(digits_fed, 3, RunConfig(seed=0, lr=lr), 0, None, None, 1)  # track 1 = the personal one
    loss = make_loss(model)
    v = w.clone()
    for idx in job.batches:
        g = torch.func.grad(loss)(v, job.x[idx], job.y[idx])
        v = v - lr * (g + lam * (v - w))
    torch.testing.assert_close(h.store.all("cpu")["v"][3], v)


# --- resume in a new process -------------------------------------------------------------------------------
RUN = textwrap.dedent("""
    import os, sys, fedlab_nb as fl
    fed = fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0, min_size=20)
    def die(r, theta, row):
        if r == int(os.environ.get("DIE_AT", "0")):
            os._exit(9)  # a kill: no clean-up, no History
    h = fl.simulate("ditto", fed, model="logreg", rounds=5, clients_per_round=3, lr=0.1, progress=False,
                    checkpoint=sys.argv[1], resume=True, callback=die)
    h.save(sys.argv[2])
""")


def test_kill_and_resume_in_a_new_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = subprocess.run([PY, script, tmp_path / "a.pt", tmp_path / "a.csv"], env=env)
    assert full.returncode == 0
    killed = subprocess.run([PY, script, tmp_path / "b.pt", tmp_path / "b.csv"], env={**env, "DIE_AT": "3"})
    assert killed.returncode == 9 and not (tmp_path / "b.csv").exists() and (tmp_path / "b.pt").exists()
    resumed = subprocess.run([PY, script, tmp_path / "b.pt", tmp_path / "b.csv"], env=env, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = pd.read_csv(tmp_path / "a.csv"), pd.read_csv(tmp_path / "b.csv")
    pd.testing.assert_frame_equal(a, b)
    assert json.loads((tmp_path / "a.json").read_text())["fingerprint"] == json.loads((tmp_path / "b.json").read_text())["fingerprint"]


def test_checkpoint_cannot_run_code(tmp_path, digits_fed):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    ckpt = tmp_path / "evil.pt"
    torch.save({"round": 0, "theta": torch.zeros(3), "state": Evil(), "rows": [], "fingerprint": "x", "store": {}}, ckpt)
    kw = dict(model="logreg", rounds=2, progress=False, checkpoint=ckpt, resume=True)
    with pytest.raises(ValueError, match="cannot be read safely"):
        fl.simulate("fedavg", digits_fed, **kw)
    assert not (tmp_path / "pwned").exists()
    ckpt.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        fl.simulate("fedavg", digits_fed, **kw)
    ckpt.write_bytes(pickle.dumps([1, 2, 3])[:5])
    with pytest.raises(ValueError, match="cannot be read safely"):
        fl.simulate("fedavg", digits_fed, **kw)


def test_fingerprint_is_the_same_in_every_process(digits_fed):
    code = ("import fedlab_nb as fl; fed = fl.federate('digits', 'dirichlet', n_clients=8, alpha=0.5, seed=0, min_size=20);"
            "print(fl.simulate('fedprox', fed, model='logreg', rounds=1, progress=False).meta['fingerprint'])")
    runs = {subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout.strip() for _ in range(2)}
    assert len(runs) == 1


# --- bad inputs the engine must name -------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [({"lr": "0.1"}, "lr must be a number"), ({"seed": -1}, "seed must be an integer"),
                                      ({"seed": 1.5}, "seed must be an integer"),
                                      ({"clients_per_round": True}, "clients_per_round must be"),
                                      ({"byzantine": [8]}, r"byzantine ids \[8\]"),
                                      ({"byzantine": [-1]}, r"byzantine ids \[-1\]"),
                                      ({"byzantine": [1.0]}, "byzantine must be client ids")])
def test_bad_engine_inputs(digits_fed, kw, match):
    with pytest.raises(ValueError, match=match):
        fl.simulate("fedavg", digits_fed, model="logreg", rounds=1, progress=False, **kw)


@pytest.mark.parametrize("outputs", [5, 12])
def test_model_outputs_must_match_classes(digits_fed, outputs):
    model = torch.nn.Linear(64, outputs)
    with pytest.raises(ValueError, match=f"outputs but the data set has 10 classes"):
        fl.simulate("fedavg", digits_fed, model=model, rounds=1, progress=False)


# --- server-side parts that broadcast, draw keyed randomness and report per-round metrics --------------
def test_rule_broadcast_reaches_transforms_and_metrics_reach_history():
    from fedlab_nb.core.messages import Transform
    from fedlab_nb.core.method import Method, weighted_mean
    seen, draws = [], []

    class CountingRule:  # a stateful rule: broadcasts a clip norm, draws keyed noise, reports a column
        def init_state(self, theta, num_clients):
            return {"n": 0, "clip": torch.tensor([2.0])}

        def broadcast(self, state):
            return {"clip_norm": state["clip"]}

        def aggregate(self, state, deltas, weights, info):
            draws.append(float(torch.rand(1, generator=info.generator(99))))
            return weighted_mean(deltas, weights), {**state, "n": state["n"] + 1}
        uses_context = True

        def metrics(self, state):
            return {"rule_rounds": float(state["n"])}

    class ReadsDown(Transform):
        def __call__(self, msgs, cstate, ctx):
            seen.append(float(ctx.down["clip_norm"]))
            return msgs, cstate

    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    h = fl.simulate(Method("probe", rule=CountingRule(), uplink=(ReadsDown(),)), fed, "logreg", rounds=3,
                    progress=False, seed=5)
    assert seen == [2.0, 2.0, 2.0]
    assert h["rule_rounds"].tolist() == [1.0, 2.0, 3.0]
    first = list(draws)
    fl.simulate(Method("probe", rule=CountingRule(), uplink=(ReadsDown(),)), fed, "logreg", rounds=3,
                progress=False, seed=5)
    assert draws[3:] == first and len(set(first)) == 3  # keyed by (seed, stream, round): repeatable, per round
