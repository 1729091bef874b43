"""Probe 42h: an eighth, independent re-run of issue 42's failure classes, aimed first at what is new since the
seventh (the eager local-training loop, the gather path, the paper-scale store and table, the benchmark scripts'
arguments, the seeds check, load_adult, DP's per-client participation check), with variants test_probe42*.py do not
try. Each test asserts the correct behaviour; a test marked xfail(strict=True) is an open finding (its reason says
what is wrong), so the suite stays green until it is fixed."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fedlab_nb as fl
from fedlab_nb import studies
from fedlab_nb.core.optim import Adam
from fedlab_nb.core.round import LocalJob
from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.engine import batched
from fedlab_nb.engine.client import make_loss, train_clients_loop
from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg
from fedlab_nb.models import flatten_params
from probes import REPO, declared, root_copy, script
from probes import numbered_finding as F_

KW = dict(rounds=1, local_epochs=1, batch_size=8, lr=0.1, progress=False, seed=0)


@pytest.fixture(scope="module")
def fed4():
    return fl.federate("digits", "iid", n_clients=4, seed=0)


def clients(xdt, ydt, n=3):
    rng = np.random.default_rng(0)
    return FederatedDataset.from_clients([(rng.normal(size=(20, 5)).astype(xdt), rng.integers(0, 3, 20).astype(ydt))
                                          for _ in range(n)])


# ================================================================================ the eager local loop (client.py)
class _Plain:
    extra_loss = None

    def correction(self, w, theta, ctx):
        return None


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.u = nn.Linear(8, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.l(x)


@pytest.mark.parametrize("build, kw", [(lambda: nn.Linear(8, 3), {}), (_Tied, {}), (_Unused, {}),
                                       (lambda: nn.Linear(8, 3), dict(optimizer=Adam()))],
                         ids=["linear", "tied weights", "unused parameter", "adam"])
def test_eager_loop_equals_the_flat_loop_bit_for_bit(build, kw):  # held
    """The module trained in place (`_train_eager`) and the flat-θ loop (any other loss_fn) take the same steps,
    also with a tied weight, a parameter the forward never uses, a repeated row and an empty batch."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
    jobs = [LocalJob(0, x[:20], y[:20], [np.arange(0, 5), np.arange(5, 20)]),
            LocalJob(1, x[20:], y[20:], [np.array([3, 3, 4]), np.arange(10)])]
    model = build()
    loss, theta = make_loss(model), flatten_params(model)
    eager = train_clients_loop(loss, theta, jobs, 0.1, _Plain(), **kw)
    flat = train_clients_loop(lambda t, a, b: loss(t, a, b), theta, jobs, 0.1, _Plain(), **kw)
    assert torch.equal(eager[0], flat[0]) and torch.equal(eager[1], flat[1])


def test_eager_loop_restores_the_module_after_an_exception(fed4):  # held
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.n = nn.Linear(64, 10), 0

        def forward(self, x):
            self.n += 1
            if self.n > 3:
                raise RuntimeError("boom")
            return self.l(x.flatten(1))
    model = Boom()
    weight, before = model.l.weight, model.l.weight.detach().clone()
    with pytest.raises(RuntimeError, match="boom"):
        fl.simulate("fedavg", fed4, model, backend="loop", **KW)
    assert model.l.weight is weight and weight.is_leaf and torch.equal(weight.detach(), before)


def test_used_rows_only_gathers_the_same_rows():  # held: the gather path (over GATHER_MIN_BYTES) re-indexes exactly
    g = torch.Generator().manual_seed(0)
    big = LocalJob(0, torch.randn(20000, 64, generator=g), torch.arange(20000), [np.array([7, 3, 3]), np.array([19999])])
    none = LocalJob(1, torch.randn(5000, 64, generator=g), torch.arange(5000), [])
    out = batched.used_rows_only([big, none])
    assert out[0].x.shape[0] == 3 and [out[0].y[b].tolist() for b in out[0].batches] == [[7, 3, 3], [19999]]
    assert out[1].batches == []


@pytest.mark.parametrize("xdt", [np.float64, np.float16, np.int64])
def test_inputs_of_another_dtype_than_the_model_are_a_named_error(xdt):
    with pytest.raises(ValueError, match=r"(?s)dtype.*(\.float\(\)|\.double\(\))"):
        fl.simulate("fedavg", clients(xdt, np.int64), "logreg", backend="loop", **KW)


def test_a_model_that_casts_its_inputs_itself_still_runs():  # held (and must stay so after finding 1's fix)
    class Double(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(5, 3).double()

        def forward(self, x):
            return self.l(x.double()).float()
    h = fl.simulate("fedavg", clients(np.float32, np.int64), Double(), backend="loop", **KW)
    assert h.theta.dtype == torch.float64 and torch.isfinite(h.theta).all()


@pytest.mark.parametrize("ydt, backend", [(np.int32, "loop"), (np.int32, "vmap"), (np.int16, "loop"),
                                         (np.uint8, "vmap")])
def test_labels_of_any_integer_dtype_from_clients_train(ydt, backend):
    h = fl.simulate("fedavg", clients(np.float32, ydt), "logreg", backend=backend, **KW)
    assert torch.isfinite(h.theta).all()


def test_a_dataset_with_non_int64_labels_is_refused_naming_y():
    from fedlab_nb.data.datasets import Dataset
    from fedlab_nb.data.partition import Partition
    x, y = torch.randn(20, 4), torch.randint(0, 2, (20,), dtype=torch.int32)
    ds = Dataset("int32", x, y, x, y, 2, (4,))
    with pytest.raises(ValueError, match=r"y_train.*int32.*\.long\(\)"):
        FederatedDataset(ds, Partition([np.arange(10), np.arange(10, 20)]))


@pytest.mark.parametrize("which", ["mixed", "none"])
def test_a_model_simulate_cannot_flatten_is_a_named_error(fed4, which):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.k = nn.Linear(64, 10), nn.Linear(10, 10).double()

        def forward(self, x):
            return self.k(self.l(x.flatten(1)).double()).float()

    class Empty(nn.Module):
        def forward(self, x):
            return x.flatten(1)[:, :10]
    with pytest.raises(ValueError, match="model"):
        fl.simulate("fedavg", fed4, Mixed() if which == "mixed" else Empty(), backend="loop", **KW)


def test_a_model_returning_a_tuple_is_a_named_error(fed4):
    class Tup(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(64, 10)

        def forward(self, x):
            return self.l(x.flatten(1)), 0
    with pytest.raises(ValueError, match="tensor"):
        fl.simulate("fedavg", fed4, Tup(), **KW)


@pytest.mark.parametrize("kw, name", [(dict(loss="mse"), "loss"), (dict(callback=5), "callback"),
                                      (dict(model_kwargs=[1]), "model_kwargs"), (dict(loss=nn.MSELoss()), "loss")],
                         ids=["loss str", "callback int", "model_kwargs list", "loss module"])
def test_simulate_checks_loss_callback_and_model_kwargs_naming_them(fed4, kw, name):
    with pytest.raises((TypeError, ValueError), match=name):
        fl.simulate("fedavg", fed4, "logreg", **{**KW, **kw})


def test_a_loss_without_reduction_is_refused_before_round_one(fed4):
    seen = []
    with pytest.raises((TypeError, ValueError), match=r"\bloss\b.*reduction") as e:
        fl.simulate("fedavg", fed4, "logreg", loss=lambda o, y: F.cross_entropy(o, y),
                    callback=lambda *a: seen.append(1), **{**KW, "rounds": 2})
    assert not seen and "unexpected keyword" not in str(e.value)


def test_a_functional_loss_still_runs_on_both_backends(fed4):  # held
    for backend in ("loop", "vmap"):
        h = fl.simulate("fedavg", fed4, "logreg", loss=F.cross_entropy, backend=backend, **KW)
        assert torch.isfinite(h.theta).all()


# ================================================================================ seeds, studies, load_adult
@pytest.mark.parametrize("seeds, match", [([0, 0], "distinct"), ([], "seed"), ([np.uint64(2 ** 63)], "seeds"),
                                          (torch.arange(2), "seeds")])
def test_grid_seeds_variants_are_refused(seeds, match):  # held
    with pytest.raises(ValueError, match=match):
        studies.grid(lambda seed: {"acc": 1.0}, [{}], seeds)


def test_grid_accepts_a_generator_of_seeds():  # held
    assert studies.grid(lambda seed: {"acc": float(seed)}, [{}], (s for s in range(3)))["acc"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("kw, name", [(dict(group_by="Sex"), "group_by"), (dict(features=["age"]), "features"),
                                      (dict(min_group_size=True), "min_group_size"), (dict(max_train=True), "max_train"),
                                      (dict(seed=-1), "seed")])
def test_load_adult_more_bad_arguments_are_named(kw, name):  # held: checked before the data is read
    from fedlab_nb.data.natural_data import load_adult
    with pytest.raises(ValueError, match=name):
        load_adult(**kw)


# ================================================================================ DP sampling
@pytest.mark.parametrize("cpr", [4, 0.4, "sampler"])
def test_dp_fixed_sampling_with_a_fractional_qk_is_refused(cpr):  # held: q = 0.35, K = 10 would run 4 a round
    fed = fl.federate("digits", "iid", n_clients=10, seed=0)
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.35, sampling="fixed")
    sampler = declared(lambda r, K, g: g.choice(K, 4, replace=False), 0.35, "fixed") if cpr == "sampler" else cpr
    with pytest.raises(ValueError, match="whole number"):
        fl.simulate(method, fed, "logreg", clients_per_round=sampler, **KW)


# ================================================================================ scripts/paper_scale.py store / table
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


def store_setup(tmp_path, **over):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    result = {"paper": "tiny", "scale": "paper", "verdict": "reproduced", "error": None, "figures": [],
              "figure_data": [], "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0",
                                             "role": "headline"}], "parameters": {"value": 2.0}, **over}
    (results / "tiny-paper.json").write_text(json.dumps(result))
    return root, results


@pytest.mark.parametrize("over", [dict(scale="smoke"), dict(paper="other")], ids=["smoke result", "other paper"])
def test_store_refuses_a_result_of_another_scale_or_paper(tmp_path, over):
    root, results = store_setup(tmp_path, **over)
    with pytest.raises(SystemExit, match="nothing stored"):
        script(REPO / "scripts" / "paper_scale.py").store("tiny", results, root)
    assert not (root / "papers" / "paper_scale" / "tiny.json").exists()


@pytest.mark.parametrize("field", ["figures", "figure_data"])
def test_store_with_a_null_figure_list_is_one_line(tmp_path, field):
    root, results = store_setup(tmp_path, **{field: None})
    with pytest.raises(SystemExit, match=field):
        script(REPO / "scripts" / "paper_scale.py").store("tiny", results, root)


def test_store_does_not_lose_a_figure_to_a_name_clash(tmp_path):
    root, results = store_setup(tmp_path, figures=["tiny-paper/a/main.png", "tiny-paper/b/main.png"])
    for d in "ab":
        (results / "tiny-paper" / d).mkdir(parents=True)
        (results / "tiny-paper" / d / "main.png").write_bytes(PNG + d.encode())
    with pytest.raises(SystemExit, match="main.png"):
        script(REPO / "scripts" / "paper_scale.py").store("tiny", results, root)


@pytest.mark.parametrize("over", [dict(wall_seconds="x"), dict(git_commit=5),
                                  dict(cpu="\x1b[2Jevil|x\ny"), dict(verdict="reproduced\x1b[2J|x\ny")],
                         ids=["wall str", "commit int", "cpu control", "verdict control"])
def test_paper_scale_table_survives_a_hostile_stored_result(tmp_path, over):
    root = root_copy(tmp_path)
    (root / "papers" / "paper_scale").mkdir(parents=True)
    (root / "papers" / "paper_scale" / "tiny.json").write_text(json.dumps(
        {"paper": "tiny", "scale": "paper", "verdict": "reproduced", "wall_seconds": 60.0, "cpu": "CPU",
         "git_commit": "abcdef0123", "claims": [{"id": "a", "verdict": "reproduced", "expect": "> 0",
                                                 "role": "headline"}], **over}))
    try:
        text = script(REPO / "scripts" / "paper_scale.py").table(root)
    except SystemExit as e:  # a one-line refusal naming the file is fine
        assert "tiny.json" in str(e)
        return
    row = next(line for line in text.splitlines() if line.startswith("| `tiny`"))
    assert "\x1b" not in text and row.count(" | ") == 5, row


# ================================================================================ benchmarks/bench_pfl.py arguments
@pytest.mark.parametrize("args", [["--clients", "7"], ["--models", "nope"], ["--clients", "abc"],
                                  ["--backends", "bogus"]])
def test_bench_pfl_bad_selection_is_one_line_before_anything_runs(tmp_path, args, monkeypatch, capsys):
    """Refused by argparse (exit status 2, usage and one line naming the option), before any workload runs."""
    bench = script(REPO / "benchmarks" / "bench_pfl.py")
    monkeypatch.setattr(bench, "bench_workload", lambda *a, **k: pytest.fail("a workload ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--no-pfl", "--headline", "no", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and args[0] in err.strip().splitlines()[-1] and "Traceback" not in err, err


@pytest.mark.parametrize("what", ["folder", "not executable"])
def test_bench_pfl_env_that_is_not_an_interpreter_is_named(tmp_path, what, monkeypatch):
    target = tmp_path / "py"
    target.mkdir() if what == "folder" else target.write_text("#!/bin/sh\n")
    monkeypatch.setenv("FEDLAB_PFL_PYTHON", str(target))
    bench = script(REPO / "benchmarks" / "bench_pfl.py")
    with pytest.raises(SystemExit, match="FEDLAB_PFL_PYTHON"):
        bench.pfl_python()


def test_bench_pfl_without_the_env_skips_with_a_message(tmp_path, monkeypatch):  # held
    monkeypatch.setenv("FEDLAB_PFL_PYTHON", str(tmp_path / "absent"))
    assert script(REPO / "benchmarks" / "bench_pfl.py").pfl_python() is None


def test_bench_pfl_defaults_select_workloads(tmp_path, monkeypatch):  # held: the tiny selection is not refused
    bench = script(REPO / "benchmarks" / "bench_pfl.py")
    ran = []
    monkeypatch.setattr(bench, "bench_workload", lambda *a, **k: ran.append(a[2]) or [])
    monkeypatch.setattr(bench, "summary", lambda table: table)
    bench.main(["--tiny", "--no-pfl", "--headline", "no", "--out", str(tmp_path), "--clients", "10"])
    assert ran == ["mlp-16"] and os.path.exists(tmp_path / "bench_pfl.csv")


# ================================================================================ checkpoints a user is handed
@pytest.fixture(scope="module")
def half_run(tmp_path_factory, fed4):
    """A checkpoint of a 3-round run stopped after round 1 (its fingerprint matches the run that resumes it)."""
    path = tmp_path_factory.mktemp("ckpt") / "run.pt"

    def stop(r, theta, row):
        if r >= 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        fl.simulate("fedavg", fed4, checkpoint=path, callback=stop, **CKPT)
    return path, torch.load(path, weights_only=True)


CKPT = dict(model="logreg", rounds=3, local_epochs=1, batch_size=8, lr=0.1, progress=False, seed=0, clients_per_round=2)


@pytest.mark.parametrize("edit", [dict(theta=torch.zeros(3)), dict(theta="nan"), dict(theta="double"),
                                  dict(round=10 ** 6), dict(round=-5), dict(round="1"), dict(rows="abc"),
                                  dict(state=None), dict(store={"x": 1})],
                         ids=["theta short", "theta nan", "theta f64", "round huge", "round -5", "round str",
                              "rows str", "state None", "store junk"])
def test_resume_refuses_a_tampered_checkpoint_naming_it(fed4, half_run, tmp_path, edit):
    from fedlab_nb.engine.checkpoint import CheckpointError
    path, good = half_run
    if edit.get("theta") == "nan":
        edit = dict(theta=torch.full_like(good["theta"], float("nan")))
    elif edit.get("theta") == "double":
        edit = dict(theta=good["theta"].double())
    bad = tmp_path / "run.pt"
    torch.save({**good, **edit}, bad)
    with pytest.raises(CheckpointError, match="run.pt"):
        fl.simulate("fedavg", fed4, checkpoint=bad, resume=True, **CKPT)


def test_resume_of_an_untouched_checkpoint_finishes_the_run(fed4, half_run, tmp_path):  # held
    path, good = half_run
    copy = tmp_path / "run.pt"
    torch.save(good, copy)
    h = fl.simulate("fedavg", fed4, checkpoint=copy, resume=True, **CKPT)
    assert len(h) == 3 and torch.equal(h.theta, fl.simulate("fedavg", fed4, **CKPT).theta)


# ================================================================================ Flower: the same model checks
@pytest.mark.parametrize("which", ["outputs", "dtype"])
def test_flower_setup_checks_the_model_as_simulate_does(fed4, which):
    pytest.importorskip("flwr")
    from fedlab_nb.flower import _setup
    model = nn.Linear(64, 3) if which == "outputs" else nn.Sequential(nn.Flatten(), nn.Linear(64, 10).double())
    with pytest.raises(ValueError, match="outputs" if which == "outputs" else "dtype"):
        _setup("fedavg", fed4, model, rounds=1, clients_per_round=2)


def test_simulate_seeds_checks_the_data_against_the_model():
    from fedlab_nb.engine.seeds import simulate_seeds
    with pytest.raises(ValueError, match="dtype"):
        simulate_seeds(fl.get_method("fedavg"), clients(np.float64, np.int64), "logreg", seeds=[0, 1], rounds=1,
                       clients_per_round=2)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.bool_, np.uint8, np.int32])
def test_flower_reply_of_another_dtype_is_refused_naming_the_client(dtype):  # held
    pytest.importorskip("flwr")
    from test_probe42c import flower_reply, flower_strategy
    s = flower_strategy(fl.federate("digits", "iid", n_clients=10, seed=0))
    bad = np.ones(s.theta.numel(), dtype)
    with pytest.raises(ValueError, match="client 0"):
        s.aggregate_train(1, [flower_reply(s, 0, bad), flower_reply(s, 1), flower_reply(s, 2)])


def test_paper_scale_table_is_not_written_through_a_link(tmp_path, monkeypatch):
    module = script(REPO / "scripts" / "paper_scale.py")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "paper_scale.md").symlink_to(victim)
    monkeypatch.setattr(module, "TABLE", tmp_path / "paper_scale.md")
    monkeypatch.setattr(module, "table", lambda root=None: "the table\n")
    with pytest.raises(SystemExit, match="link"):
        module.main([])
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("name, args", [("bench_seeds", ["--clients", "0"]), ("bench_seeds", ["--seeds", "0"]),
                                        ("bench_seeds", ["--backends", "bogus"]), ("bench_scale", ["--clients", "0"]),
                                        ("bench_scale", ["--backends", "bogus"]), ("bench_round", ["--clients", "-3"]),
                                        ("bench_round", ["--rounds", "0"]), ("bench_round", ["--backend", "bogus"])])
def test_benchmark_arguments_are_checked_by_argparse(tmp_path, name, args):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args, "--out", str(tmp_path)]
                          if name != "bench_round" else [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode == 2 and "Traceback" not in done.stderr and args[0] in last, done.stderr[-500:]


@pytest.mark.parametrize("method, kw", [("fedavg", {}), ("fedavg", dict(stragglers=0.5)),
                                        ("fedavg", dict(clients_per_round=3)), ("scaffold", {})])
def test_gather_path_gives_the_same_run_as_the_full_copy(method, kw, monkeypatch):  # held
    """vmap with only the used rows gathered (forced: GATHER_MIN_BYTES = 0) equals the full copy bit for bit."""
    fed = fl.federate("digits", "dirichlet", n_clients=10, alpha=0.5, seed=0)
    run = dict(backend="vmap", rounds=2, local_steps=1, batch_size=4, lr=0.1, progress=False, seed=0, **kw)
    monkeypatch.setattr(batched, "GATHER_MIN_BYTES", 0)
    gathered = fl.simulate(method, fed, "mlp", **run)
    monkeypatch.setattr(batched, "GATHER_MIN_BYTES", 1 << 62)
    copied = fl.simulate(method, fed, "mlp", **run)
    assert torch.equal(gathered.theta, copied.theta)
    assert gathered["train_loss"].tolist() == copied["train_loss"].tolist()


def _ignores_reduction(outputs, y, **kw):
    return F.cross_entropy(outputs, y)


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_a_loss_that_ignores_reduction_is_refused(fed4, backend):
    with pytest.raises(ValueError, match=r"\bloss\b.*reduction"):
        fl.simulate("fedavg", fed4, "logreg", loss=_ignores_reduction, backend=backend, **KW)


def test_dp_rule_with_simulate_seeds_is_refused(fed4):  # held: simulate_seeds never runs DP (no sampler check there)
    from fedlab_nb.engine.seeds import simulate_seeds
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    with pytest.raises(ValueError, match="cannot batch"):
        simulate_seeds(method, fed4, "logreg", seeds=[0, 1], rounds=1, clients_per_round=2)


# ================================================================================ FederatedDataset.from_clients input
@pytest.mark.parametrize("case", ["int", "bare array", "ragged", "text", "one-hot", "test width", "nan target"])
def test_from_clients_bad_input_is_a_named_error(case):
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    y = np.arange(10) % 3
    args, kw = {"int": (5,), "bare array": ([x],), "ragged": ([([[1.0], [1.0, 2.0]], [0, 1])],),
                "text": ([(np.array(["a"] * 10, dtype=object), y)],), "one-hot": ([(x, np.eye(3, dtype=int)[y])],),
                "test width": ([(x, y)],), "nan target": ([(x, np.full(10, np.nan))],)}[case], {}
    if case == "test width":
        kw = dict(test=(np.zeros((4, 5), np.float32), np.zeros(4, int)))
    with pytest.raises(ValueError, match=r"clients|test|\by\b"):
        fed = FederatedDataset.from_clients(*args, **kw)
        fl.simulate("fedavg", fed, "logreg", **KW)
