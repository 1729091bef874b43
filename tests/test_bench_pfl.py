"""benchmarks/bench_pfl.py: fedlab_nb against pfl-research. The export the pfl side reads is exactly what
`simulate` trains (no pfl needed); with .venv-pfl (scripts/setup_pfl.sh) the tiny comparison runs end to end."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.engine import server
from fedlab_nb.models import flatten_params, make_model

from test_vmap import _bench


@pytest.fixture(scope="module")
def bench():
    return _bench("bench_pfl")


def test_export_round_trip_is_what_simulate_trains(bench, tmp_path, monkeypatch):
    """The pfl side's view of the exported workload (pfl_side.load_workload, build_model) holds the initial
    weights, and in each round the clients `simulate` trains, each with its rows in `simulate`'s batch order."""
    fed = fl.federate("digits", "dirichlet", n_clients=6, alpha=0.5, seed=0, test_fraction=0.0, min_size=2)
    torch.manual_seed(0)
    model = make_model("mlp", fed.input_shape, fed.num_classes, hidden=(16,))
    cfg = server.RunConfig(batch_size=10, lr=0.05, local_epochs=1)
    meta = bench.export_workload(tmp_path, fed, "mlp", {"hidden": (16,)}, model, cfg, rounds=3, clients_per_round=4)
    w = bench.SIDE.load_workload(tmp_path)
    twin = bench.SIDE.build_model(w["meta"], w["state_dict"])
    assert type(twin).__name__ == "MLP" and torch.equal(flatten_params(twin), flatten_params(model))

    trained = []   # (round, client, rows in batch order) as simulate's loop backend builds them
    real = server.local_job

    def spy(fed_, k, cfg_, rnd, *a, **kw):
        job = real(fed_, k, cfg_, rnd, *a, **kw)
        trained.append((rnd, int(k), job.x[np.concatenate(job.batches)]))
        return job
    monkeypatch.setattr(server, "local_job", spy)
    fl.simulate("fedavg", fed, model=model, rounds=3, clients_per_round=4, batch_size=10, lr=0.05,
                backend="loop", eval_every=10**6, progress=False)
    assert [(r, k) for r, k, _ in trained] == [(r, int(k)) for r in range(3) for k in w["cohorts"][r]]
    for r, k, x in trained:
        assert np.array_equal(w["x_train"][w["rows"](r, k)], x.numpy())
    assert meta["rows_per_round"] == [sum(len(x) for r_, _, x in trained if r_ == r) for r in range(3)]
    assert np.array_equal(w["x_test"], fed.x_test.numpy()) and np.array_equal(w["y_test"], fed.y_test.numpy())


def test_headline_model_and_data(bench):
    """pfl's simple CNN (no dropout) on the synthetic images: 1,000 users' shapes, a cohort's round on vmap."""
    fed = bench.synthetic_images(users=12, side=8, rows=6)
    assert fed.num_clients == 12 and fed.input_shape == (3, 8, 8) and fed.dataset.x_train.shape[1] == 192
    net = bench.SIDE.SimpleCNN(fed.input_shape, fed.num_classes)
    assert net(fed.x_test[:3]).shape == (3, 10)
    big = bench.SIDE.SimpleCNN((3, 32, 32), 10)   # pfl's CIFAR-10 shape: 14·14·64 features into the dense layer
    assert big.head[0].in_features == 14 * 14 * 64
    hist = fl.simulate("fedavg", fed, model=net, rounds=1, clients_per_round=3, batch_size=10, backend="vmap",
                       progress=False)
    assert hist.meta["backend_used"] == "vmap" and np.isfinite(hist.final("test_acc"))


def test_without_pfl_ours_still_runs(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDLAB_PFL_PYTHON", str(tmp_path / "absent" / "python"))
    table = bench.main(["--tiny", "--backends", "fused", "--headline", "no", "--out", str(tmp_path)])
    assert bench.SKIP_MESSAGE in capsys.readouterr().out
    assert set(table["backend"]) == {"fused"} and (tmp_path / "bench_pfl.csv").exists()


@pytest.mark.skipif(_bench("bench_pfl").pfl_python() is None, reason="no .venv-pfl (bash scripts/setup_pfl.sh)")
def test_tiny_comparison_with_pfl(bench, tmp_path):
    """Both sides train the same rows each round (asserted in the script) and end at the same weights up to float
    rounding (the same batches from the same θ₀), so at the same test accuracy; every time is a positive number."""
    table = bench.main(["--tiny", "--out", str(tmp_path)])
    summ = bench.summary(table)
    assert {"loop", "vmap", "fused", "pfl"} <= set(table["backend"])
    assert len(summ) == 2 and set(summ["model"]) == {"mlp-16", "pfl_simple_cnn"}
    assert (summ["pfl_max_abs_dtheta"] < 1e-5).all()
    assert ((summ["acc_pfl"] - summ["acc_loop"]).abs() < 0.01).all()   # the same predictions but a rare near tie
    assert (summ[["loop_s", "vmap_s", "pfl_s"]] > 0).all().all() and (summ["best_vs_pfl"] > 0).all()
    assert dict(zip(summ["model"], summ["best"])) == {"mlp-16": "fused", "pfl_simple_cnn": "loop"}   # what auto picks
    assert (tmp_path / "bench_pfl_summary.csv").exists()


def test_device_is_checked(bench, tmp_path, capsys):
    """--device: a name torch does not know, or cuda where torch sees no GPU, stops with the fix; cpu is the default."""
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--no-pfl", "--device", "gpu0", "--out", str(tmp_path)])
    assert "is not a torch device; use cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.main(["--tiny", "--no-pfl", "--device", "cuda", "--out", str(tmp_path)])
        assert "torch sees no CUDA device here" in capsys.readouterr().err
    assert bench.parse_args(["--tiny"]).device == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available() or _bench("bench_pfl").pfl_python() is None,
                    reason="needs a CUDA device and a python with pfl (benchmarks/device/pfl.sh)")
def test_tiny_comparison_on_cuda(bench, tmp_path):
    """On a GPU both sides train on the device: the same rows, the same weights up to float rounding."""
    table = bench.main(["--tiny", "--device", "cuda", "--out", str(tmp_path)])
    summ = bench.summary(table)
    assert set(table["device"]) == {"cuda:0"} or set(table["device"]) == {"cuda"}
    assert (summ["pfl_max_abs_dtheta"] < 1e-4).all() and (summ[["loop_s", "pfl_s"]] > 0).all().all()


def test_loop_against_a_bare_torch_loop_tiny():
    """benchmarks/loop_vs_torch.py --tiny runs our loop's round and both bare loops on the same clients and times
    each (a check that it runs; no timing is compared)."""
    best = _bench("loop_vs_torch").main(["--tiny", "--repeats", "1"])
    assert set(best) == {"ours", "bare_backward", "bare_grad"} and all(t > 0 for t in best.values())
