"""The `vmap` backend (engine/batched.py) computes the same local SGD as the `loop` backend."""
import dataclasses

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core import SGD
from fedlab_nb.engine import batched
from fedlab_nb.engine.batched import plan_chunks, train_clients_vmap
from fedlab_nb.engine.client import LocalJob, batch_schedule, make_loss, train_clients_loop
from fedlab_nb.methods import LocalObjective
from fedlab_nb.methods.heterogeneity.fedprox import ProximalObjective
from fedlab_nb.methods.heterogeneity.scaffold import ControlVariateObjective
from fedlab_nb.models import flatten_params, make_model

COLUMNS = ["train_loss", "test_loss", "test_acc", "client_acc_mean", "client_acc_std", "client_acc_p10"]


@pytest.fixture
def run_both(monkeypatch):
    """fl.simulate on both backends, checking that the vmap run really went through train_clients_vmap."""
    calls = []
    real = batched.train_clients_vmap
    monkeypatch.setattr(batched, "train_clients_vmap", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(fed, method, **kw):
        kw = dict(rounds=3, clients_per_round=5, lr=0.1, progress=False, seed=0) | kw
        loop = fl.simulate(method, fed, backend="loop", **kw)
        assert not calls
        vmap = fl.simulate(method, fed, backend="vmap", **kw)
        assert len(calls) == kw["rounds"]
        return loop, vmap
    return run


def assert_same_history(loop, vmap):
    for col in COLUMNS:
        np.testing.assert_allclose(vmap[col].to_numpy(), loop[col].to_numpy(), atol=1e-4, rtol=0, err_msg=col)
    torch.testing.assert_close(vmap.theta, loop.theta, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "scaffold", "fednova", "fedadam"])
def test_simulate_vmap_equals_loop_noniid(run_both, digits_fed, method):
    """Dirichlet(0.5) digits: unequal sizes, 2 local epochs, 40 % stragglers, an MLP."""
    m = fl.get_method(method, **({"mu": 0.1} if method == "fedprox" else {}))
    loop, vmap = run_both(digits_fed, m, model="mlp", model_kwargs={"hidden": (16,)}, local_epochs=2,
                          batch_size=16, stragglers=0.4)
    assert digits_fed.sizes.min() < digits_fed.sizes.max()  # the case the masks are for
    assert_same_history(loop, vmap)


def test_simulate_vmap_equals_loop_iid_local_steps_logreg(run_both):
    fed = fl.federate("digits", "iid", n_clients=6, seed=1)
    loop, vmap = run_both(fed, "fedavg", model="logreg", local_steps=7, batch_size=10, clients_per_round=None)
    assert_same_history(loop, vmap)


def test_simulate_vmap_equals_loop_cnn(run_both, digits_fed):
    loop, vmap = run_both(digits_fed, fl.get_method("fedprox", mu=0.05), model="cnn", rounds=2, clients_per_round=3,
                          model_kwargs={"channels": (4, 8), "hidden": 16}, batch_size=32, stragglers=0.5)
    assert_same_history(loop, vmap)


# --- train_clients_vmap against train_clients_loop directly ------------------------------------------
def make_jobs(n_clients=7, d_in=12, classes=4, batch=5, seed=0, d=None):
    """Clients of very different sizes; some run fixed steps, one stops early (a straggler)."""
    g = np.random.default_rng(seed)
    jobs = []
    for k in range(n_clients):
        n = int(g.integers(3, 40))
        x = torch.as_tensor(g.normal(size=(n, d_in)), dtype=torch.float32)
        y = torch.as_tensor(g.integers(0, classes, n))
        steps = None if k % 3 else int(g.integers(1, 9))
        batches = batch_schedule(n, batch, epochs=1 + k % 2, steps=steps, g=g)
        if k == 4:
            batches = batches[:1]
        ctx = None if d is None else torch.as_tensor(g.normal(size=d) * 0.1, dtype=torch.float32)
        jobs.append(LocalJob(k, x, y, batches, ctx))
    return jobs


@pytest.mark.parametrize("objective", [LocalObjective(), ProximalObjective(mu=0.3), ControlVariateObjective()])
def test_train_clients_vmap_equals_loop(objective):
    torch.manual_seed(0)
    model = make_model("mlp", (12,), 4, hidden=(8, 6))
    theta = flatten_params(model)
    jobs = make_jobs(d=theta.numel() if isinstance(objective, ControlVariateObjective) else None)
    assert len({len(j.batches) for j in jobs}) > 2 and len({len(j.y) for j in jobs}) > 2
    d_loop, l_loop = train_clients_loop(make_loss(model), theta, jobs, 0.2, objective)
    d_vmap, l_vmap = train_clients_vmap(make_loss(model), theta, jobs, 0.2, objective)
    assert d_vmap.shape == (len(jobs), theta.numel())
    assert (d_loop.abs().amax(1) > 1e-4).all()  # every client really moved
    torch.testing.assert_close(d_vmap, d_loop, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l_vmap, l_loop, atol=1e-6, rtol=1e-5)


def test_model_free_loss_falls_back_to_rowwise():
    """A loss function that hides its model still gives the loop's result (row-by-row masked mean)."""
    torch.manual_seed(1)
    model = make_model("logreg", (12,), 4)
    theta, inner = flatten_params(model), make_loss(model)
    opaque = lambda th, x, y: inner(th, x, y)  # noqa: E731 — its closure holds a function, not a module
    assert batched.model_of(opaque) is None and batched.model_of(inner) is model
    jobs = make_jobs(seed=3)
    d_loop, l_loop = train_clients_loop(opaque, theta, jobs, 0.3, LocalObjective())
    d_vmap, l_vmap = train_clients_vmap(opaque, theta, jobs, 0.3, LocalObjective())
    torch.testing.assert_close(d_vmap, d_loop, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l_vmap, l_loop, atol=1e-6, rtol=1e-5)


def test_refuses_objective_that_is_not_vmappable():
    class Stateful(LocalObjective):
        vmappable = False
    model = make_model("logreg", (12,), 4)
    with pytest.raises(ValueError, match="backend='loop'"):
        train_clients_vmap(make_loss(model), flatten_params(model), make_jobs(), 0.1, Stateful())


# --- chunking ----------------------------------------------------------------------------------------
def test_plan_chunks_respects_budget():
    cost = np.array([5, 5, 5, 20, 1, 1])
    chunks = plan_chunks(cost, budget=10)
    assert [c.tolist() for c in chunks] == [[0, 1], [2], [3], [4, 5]]
    assert np.concatenate(chunks).tolist() == list(range(6))
    assert len(plan_chunks(cost, budget=10**9)) == 1


def test_chunked_equals_unchunked(monkeypatch):
    torch.manual_seed(2)
    model = make_model("mlp", (12,), 4, hidden=(8,))
    theta = flatten_params(model)
    jobs = make_jobs(n_clients=9, d=theta.numel())
    objective = ControlVariateObjective()
    whole = train_clients_vmap(make_loss(model), theta, jobs, 0.2, objective, budget=10**12)
    calls = []
    real = batched._train_chunk
    monkeypatch.setattr(batched, "_train_chunk", lambda *a: calls.append(len(a[3])) or real(*a))
    monkeypatch.setattr(batched, "MEMORY_BUDGET", 1)  # one client per chunk
    per_client = train_clients_vmap(make_loss(model), theta, jobs, 0.2, objective)
    assert calls == [1] * len(jobs)
    calls.clear()
    cost_one = 4 * theta.numel() * (batched.PARAM_COPIES + 1)
    some = train_clients_vmap(make_loss(model), theta, jobs, 0.2, objective, budget=3 * cost_one + 10_000)
    assert 1 < len(calls) < len(jobs)
    for got in (per_client, some):
        torch.testing.assert_close(got[0], whole[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], whole[1], atol=1e-6, rtol=1e-5)


def test_activation_estimate_grows_with_width():
    x, y = torch.randn(2, 20), torch.tensor([0, 1])
    small, wide = (make_model("mlp", (20,), 2, hidden=(h,)) for h in (8, 256))
    est = [batched.activation_bytes_per_row(make_loss(m), flatten_params(m), x, y) for m in (small, wide)]
    assert 0 < est[0] < est[1]


def test_activation_estimate_measured_once_per_model_and_shape(monkeypatch):
    calls = []
    measure = batched.activation_bytes_per_row
    monkeypatch.setattr(batched, "activation_bytes_per_row", lambda *a: calls.append(1) or measure(*a))
    model = make_model("mlp", (20,), 2, hidden=(8,))
    loss, theta, y = make_loss(model), flatten_params(model), torch.tensor([0, 1])
    first = [batched.cached_activation_bytes(loss, theta, torch.randn(2, 20), y, model) for _ in range(3)]
    assert len(calls) == 1 and first == [measure(loss, theta, torch.randn(2, 20), y)] * 3
    one_row = batched.cached_activation_bytes(loss, theta, torch.randn(1, 20), y[:1], model)
    assert len(calls) == 2 and one_row == measure(loss, theta, torch.randn(1, 20), y[:1])  # the 1-row path: its own entry
    other = make_model("mlp", (20,), 2, hidden=(256,))
    assert batched.cached_activation_bytes(make_loss(other), flatten_params(other), torch.randn(2, 20), y, other) > first[0]
    assert len(calls) == 3


def _bench(name: str = "bench_backends"):
    """benchmarks/<name>.py as a module (a script, not part of the package)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_backends_tiny(tmp_path):
    """The benchmark's CI mode runs in-process and writes its table."""
    table = _bench().main(["--tiny", "--out", str(tmp_path)])
    assert {"loop", "vmap", "limit", "floor"} <= set(table["backend"])
    assert (tmp_path / "bench_backends.csv").exists()
    assert np.isfinite(table["seconds"]).all() and (table["seconds"] > 0).all()
    floor = table[table["backend"] == "floor"]
    assert (floor["floor_s"] == floor[["memory_floor_s", "flop_floor_s"]].max(axis=1)).all()


def test_bench_round_small_rounds():
    """bench_round.py's small-round mode (the per-round overhead) runs and prints its JSON line."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_round.py"
    args = ["--dataset", "digits", "--model", "logreg", "--clients", "4", "--local-steps", "1", "--batch-size", "8",
            "--rounds", "3", "--repeats", "1"]
    line = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True).stdout
    got = json.loads(line.strip().splitlines()[-1])
    assert got["rounds"] == 3 and got["dataset"] == "digits" and got["seconds_per_round"] > 0


def test_bench_products_times_every_product_of_the_fused_step():
    """bench_products.py finds the forward, delta and update products of each Linear layer in a fused round,
    with as many calls per round as the round has steps, each timed (no comparison of times: a loaded machine
    reorders them)."""
    args = ["--dataset", "digits", "--clients", "4", "--hidden", "16", "--rounds", "2", "--rows", "10"]
    got = _bench("bench_products").main(args)
    rows = {(r["kind"], r["layer"]): r for r in got["products"]}
    # digits: 64 features, 10 classes; δ is not propagated below the first layer
    assert set(rows) == {("forward", "16x64"), ("update", "16x64"), ("forward", "10x16"), ("update", "10x16"),
                         ("delta", "10x16")}
    assert len({r["calls"] for r in rows.values()}) == 1 and got["products_s"] > 0 and got["fused_s"] > 0
    assert all(r["gflops"] > 0 for r in rows.values()) and got["forward_rate_by_rows"][10] > 0


def test_roofline_flops_per_row_is_the_matmul_count():
    """Forward 2·W, weight gradients 2·W, input gradients 2·W of every layer but the first (x needs none)."""
    import fedlab_nb as fl
    from fedlab_nb.engine import server
    from fedlab_nb.engine.client import make_loss
    from fedlab_nb.models import flatten_params, make_model
    bench = _bench()
    fed = fl.federate("digits", "iid", n_clients=2, seed=0)
    jobs = server._local_jobs(fed, np.arange(2), server.RunConfig(batch_size=10, lr=0.1, local_epochs=1), 0, None)
    model = make_model("mlp", fed.input_shape, 10, hidden=(16,))
    w1, w2 = 64 * 16, 16 * 10
    assert bench.flops_per_row(make_loss(model), flatten_params(model), jobs[0], 10) == 4 * (w1 + w2) + 2 * w2


# --- the fused Linear-chain step (engine/fused.py) -------------------------------------------------
@pytest.mark.parametrize("name,kwargs", [("logreg", {}), ("mlp", {"hidden": (8, 6)}), ("mlp", {"hidden": (5,)}),
                                         ("torch.nn.Linear", {})])
def test_fused_step_equals_loop(fused_steps, name, kwargs):
    calls = fused_steps
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 4) if name == "torch.nn.Linear" else make_model(name, (12,), 4, **kwargs)
    theta = flatten_params(model)
    jobs = make_jobs()
    d_loop, l_loop = train_clients_loop(make_loss(model), theta, jobs, 0.2, LocalObjective())
    d_fused, l_fused = batched.train_clients_fused(make_loss(model), theta, jobs, 0.2, LocalObjective())
    assert calls and (d_loop.abs().amax(1) > 1e-4).all()
    torch.testing.assert_close(d_fused, d_loop, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l_fused, l_loop, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("row_bytes", [0, 2**30])   # rows written one by one / a parameter tensor at a time
@pytest.mark.parametrize("budget", [1, None])       # one client per chunk / one chunk
def test_fused_from_start_rows_in_chunks_equals_loop(monkeypatch, weights, row_bytes, budget):
    """Per-client start rows (a client store), weights or Δ, one or several chunks: the per-parameter stacks
    are written back into the right rows."""
    from fedlab_nb.engine import fused as fused_step
    monkeypatch.setattr(fused_step, "ROW_BYTES", row_bytes)
    torch.manual_seed(0)
    model = make_model("mlp", (12,), 4, hidden=(8, 6))
    theta, jobs = flatten_params(model), make_jobs()
    start = theta + 0.1 * torch.randn(len(jobs), theta.numel())
    loop = train_clients_loop(make_loss(model), theta, jobs, 0.2, LocalObjective(), start=start, weights=weights)
    monkeypatch.setattr(batched, "MEMORY_BUDGET", budget)
    fused = batched.train_clients_fused(make_loss(model), theta, jobs, 0.2, LocalObjective(), start=start.clone(),
                                        weights=weights)
    torch.testing.assert_close(fused[0], loop[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused[1], loop[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("block_bytes", [1, 2 * 4 * 90, 3 * 4 * 90])
def test_fused_cache_blocks_change_nothing(monkeypatch, block_bytes):
    """Blocks of 1, 2 or 3 clients (uneven step counts, a straggler) give the one-block result bit for bit."""
    from fedlab_nb.engine import fused
    torch.manual_seed(0)
    model = make_model("mlp", (12,), 4, hidden=(5,))   # d = 12·5 + 5 + 5·4 + 4 = 89 ≤ 90
    theta, jobs = flatten_params(model), make_jobs()
    one = batched.train_clients_fused(make_loss(model), theta, jobs, 0.2, LocalObjective())
    monkeypatch.setattr(fused, "BLOCK_BYTES", block_bytes)
    assert fused.block_clients(theta.numel(), 4) == max(1, block_bytes // (4 * 89))
    blocked = batched.train_clients_fused(make_loss(model), theta, jobs, 0.2, LocalObjective())
    assert torch.equal(blocked[0], one[0]) and torch.equal(blocked[1], one[1])


def test_fused_backend_runs_fused_only_where_it_is_exact(fused_steps, digits_fed):
    from fedlab_nb.engine import fused
    calls = fused_steps
    kw = dict(rounds=2, clients_per_round=5, lr=0.1, progress=False, seed=0, model="mlp",
              model_kwargs={"hidden": (16,)}, batch_size=16, stragglers=0.4)
    loop = fl.simulate("fedavg", digits_fed, backend="loop", **kw)
    got = fl.simulate("fedavg", digits_fed, backend="fused", **kw)
    assert calls and got.meta["backend_used"] == "fused"
    assert_same_history(loop, got)
    calls.clear()   # MOON adds a loss term on the model: the vmapped autograd step runs instead, same results
    moon = fl.get_method("moon", mu=1.0)
    assert_same_history(fl.simulate(moon, digits_fed, backend="loop", **kw), fl.simulate(moon, digits_fed, backend="fused", **kw))
    assert not calls
    assert fused.linear_layers(make_model("cnn", (1, 8, 8), 10)) is None
    assert fused.linear_layers(torch.nn.Linear(4, 3, bias=False)) is None


def test_auto_trains_a_conv_net_on_the_loop_on_a_cpu_only(digits_fed):
    """On a CPU the loop beat vmap on every CNN workload of bench_pfl (2026-12-07): 'auto' picks it for conv nets;
    an MLP keeps the fused step, a GPU keeps vmap, and backend='vmap' / 'fused' still run vmap."""
    from fedlab_nb.engine.server import auto_backend
    cnn, mlp = make_model("cnn", (1, 8, 8), 10), make_model("mlp", (64,), 10)
    assert auto_backend(cnn, "cpu") == "loop" and auto_backend(cnn, torch.device("cuda:0")) == "fused"
    assert auto_backend(mlp, "cpu") == auto_backend(None) == "fused"
    kw = dict(model="cnn", rounds=1, clients_per_round=2, progress=False)
    assert fl.simulate("fedavg", digits_fed, **kw).meta["backend_used"] == "loop"
    for forced in ("vmap", "fused"):
        assert fl.simulate("fedavg", digits_fed, backend=forced, **kw).meta["backend_used"] == forced


@pytest.mark.parametrize("optimizer", [None, SGD(momentum=0.9, weight_decay=1e-3)])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("method,kwargs", [("fedprox", {"mu": 0.5}), ("scaffold", {}), ("feddyn", {"alpha": 0.1})])
def test_fused_step_with_correction_terms_equals_loop(monkeypatch, fused_steps, digits_fed, method, kwargs, blocked,
                                                      optimizer):
    """FedProx's μ(w − θ), SCAFFOLD's c − c_k (client context), FedDyn's both, with plain SGD or a momentum
    optimiser taking gradient + term: the fused step (one cache block, or blocks of a few clients) gives the
    loop's History over rounds whose client state carries over."""
    from fedlab_nb.engine import fused
    calls = fused_steps
    if blocked:  # two clients per block: the context rows must follow their block
        monkeypatch.setattr(fused, "BLOCK_BYTES", 2 * 4 * (64 * 8 + 8 + 8 * 10 + 10))
    kw = dict(rounds=3, clients_per_round=6, lr=0.1, progress=False, seed=0, model="mlp",
              model_kwargs={"hidden": (8,)}, batch_size=16, stragglers=0.4)
    def build():
        m = fl.get_method(method, **kwargs)
        return m if optimizer is None else dataclasses.replace(m, optimizer=optimizer)
    loop = fl.simulate(build(), digits_fed, backend="loop", **kw)
    got = fl.simulate(build(), digits_fed, **kw)   # "auto": fused where it applies
    assert calls and got.meta["backend_used"] == "fused"
    assert_same_history(loop, got)


@pytest.mark.parametrize("block_bytes", [1, 3 * 4 * 90, 2**30])
def test_fused_clients_without_steps_keep_theta(monkeypatch, block_bytes):
    """Clients with no local step (and cache blocks of only such clients) come back at θ, as on the loop."""
    from fedlab_nb.engine import fused
    monkeypatch.setattr(fused, "BLOCK_BYTES", block_bytes)
    torch.manual_seed(0)
    model = make_model("mlp", (12,), 4, hidden=(5,))
    theta, jobs = flatten_params(model), make_jobs()
    for k in (1, 5, 6):
        jobs[k] = LocalJob(jobs[k].client_id, jobs[k].x, jobs[k].y, [], None)
    loop = train_clients_loop(make_loss(model), theta, jobs, 0.2, LocalObjective(), weights=True)
    got = batched.train_clients_fused(make_loss(model), theta, jobs, 0.2, LocalObjective(), weights=True)
    assert all(torch.equal(got[0][k], theta) for k in (1, 5, 6))
    torch.testing.assert_close(got[0], loop[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fuse", [False, True])
def test_few_steps_on_large_clients_gather_only_their_rows(monkeypatch, fuse):
    """One step of a small batch on clients of hundreds of rows: the chunk copies only the rows the batches use
    (batched.used_rows_only), with the same result as the loop; a client without steps stays at θ."""
    torch.manual_seed(0)
    model = make_model("mlp", (12,), 4, hidden=(5,))
    theta, jobs = flatten_params(model), make_jobs(n_clients=4)
    big = [LocalJob(j.client_id, j.x.repeat(40, 1), j.y.repeat(40), [np.array([3, len(j.y) * 40 - 1, 7])], None)
           for j in jobs]
    big[2] = LocalJob(big[2].client_id, big[2].x, big[2].y, [], None)
    seen = []
    real = batched.used_rows_only
    monkeypatch.setattr(batched, "GATHER_MIN_BYTES", 0)  # these clients are small: gather all the same
    monkeypatch.setattr(batched, "used_rows_only", lambda js: seen.append(out := real(js)) or out)
    loop = train_clients_loop(make_loss(model), theta, big, 0.2, LocalObjective(), weights=True)
    got = batched.train_clients_vmap(make_loss(model), theta, big, 0.2, LocalObjective(), weights=True, fuse=fuse)
    assert seen and sum(len(j.y) for j in seen[0]) == 3 * 3 + 1     # 3 rows per stepping client, 1 padding row
    assert torch.equal(got[0][2], theta)
    torch.testing.assert_close(got[0], loop[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], loop[1], atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(batched, "GATHER_MIN_BYTES", 1 << 22)  # small data: the jobs pass through untouched
    assert batched.used_rows_only(big) is big
