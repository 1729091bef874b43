"""fedlab_nb against Apple's pfl-research (PyPI `pfl` 0.6.0) on bench_backends.py's workloads, in one run:
whole FedAvg rounds (local training, aggregation, server update) on our loop, vmap and fused backends, in
pfl's own simulation loop, and (mlp-64-32, up to 100 clients, when flwr is installed) in Flower.

    bash scripts/setup_pfl.sh                                   # once: .venv-pfl with torch 2.13.0 and pfl 0.6.0
    OMP_NUM_THREADS=1 python benchmarks/bench_pfl.py            # every workload (long: see benchmarks/README.md)
    OMP_NUM_THREADS=1 python benchmarks/bench_pfl.py --models mlp-64-32 --clients 100
    python benchmarks/bench_pfl.py --tiny --out /tmp/bench      # seconds; tests/test_pfl_bench.py runs this

pfl cannot be installed in the project's .venv (it pins dp-accounting<0.6, which conflicts with flwr[dp]), so its
side runs in `.venv-pfl` as a subprocess (`benchmarks/pfl_side.py`); this script skips it with a message when
that environment is absent. Per workload this side exports to a temporary folder the training and test rows,
each client's partition (row indices), each round's batch order (fedlab_nb's own schedule) and the model's
initial state_dict; the pfl side loads them, so both sides start from the same weights and train the same rows
in the same batches with the same lr and weighting (see pfl_side.py).

Each side runs `--rounds` rounds (default 5): the first is a warm-up and the last is not timed either (ours
evaluates the test set in it); the table gives the median CPU seconds of the rounds between. Same-work checks:
both sides train the same number of rows in every round (asserted), and after the rounds both models' test
accuracy and the largest weight difference from our loop's are reported, pfl's beside our other backends' (the
same batches, so they agree up to float rounding, which grows over the rounds on the CNNs).
Prints one table (CPU seconds of a whole round; Flower: wall seconds) with the machine's load average and CPU,
and writes `bench_pfl.csv` to --out.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import fedlab_nb as fl
from fedlab_nb.core.streams import SAMPLE
from fedlab_nb.engine import server
from fedlab_nb.engine.fused import linear_layers
from fedlab_nb.engine.sampling import make_sampler
from fedlab_nb.models import flatten_params, make_model
from fedlab_nb.utils import rng

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared argparse types beside this script
from bench_args import device, positive, whole  # noqa: E402
ROOT = HERE.parent
PFL_SIDE = HERE / "pfl_side.py"


def _bench_backends():
    spec = importlib.util.spec_from_file_location("bench_backends", HERE / "bench_backends.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pfl_side():
    spec = importlib.util.spec_from_file_location("pfl_side", PFL_SIDE)   # numpy and torch only; pfl is imported
    mod = importlib.util.module_from_spec(spec)                          # inside its run(), in .venv-pfl
    spec.loader.exec_module(mod)
    return mod


BB, SIDE = _bench_backends(), _pfl_side()
MODELS, FULL = BB.MODELS, BB.FULL          # the same workloads as bench_backends.py, every client each round
TINY = [("digits", {}, 10, "mlp-16")]
# pfl-research's headline workload (its CIFAR-10 benchmark): simple_cnn, 1,000 users, cohort 50, batch 10, one
# epoch, on synthetic 32×32×3 images (CIFAR-10 is not available offline here): (users, cohort, side, mean rows)
HEADLINE = dict(users=1000, cohort=50, side=32, rows=50)
HEADLINE_TINY = dict(users=40, cohort=5, side=8, rows=20)


def synthetic_images(users: int, side: int, rows: int, classes: int = 10, test: int = 2000, seed: int = 0):
    """A learnable stand-in for CIFAR-10: each class a fixed random 3×side×side pattern plus noise, values in
    [0, 1], stored flat (C×H×W); users hold IID rows, Poisson(rows) of them (at least 1). A FederatedDataset
    with no local test split."""
    g = np.random.default_rng(seed)
    d = 3 * side * side
    proto = g.random((classes, d), dtype=np.float32)

    def draw(n):
        y = g.integers(0, classes, n)
        return np.clip(0.5 * proto[y] + 0.5 * g.random((n, d), dtype=np.float32), 0, 1).astype(np.float32), y
    sizes = np.maximum(1, g.poisson(rows, users))
    clients = [draw(int(n)) for n in sizes]
    x_test, y_test = draw(test)
    fed = fl.FederatedDataset.from_clients(clients, test=(x_test, y_test), name=f"synthetic{side}", num_classes=classes)
    fed.dataset.input_shape = (3, side, side)
    return fed


def pfl_python() -> Path | None:
    """The interpreter of the pfl environment (FEDLAB_PFL_PYTHON, else .venv-pfl/bin/python), or None."""
    path = Path(os.environ.get("FEDLAB_PFL_PYTHON", ROOT / ".venv-pfl" / "bin" / "python"))
    if not path.exists():
        return None
    if not path.is_file() or not os.access(path, os.X_OK):
        raise SystemExit(f"FEDLAB_PFL_PYTHON / .venv-pfl: {path} is not an executable python interpreter; point "
                         "FEDLAB_PFL_PYTHON at one (e.g. .venv-pfl/bin/python) or pass --no-pfl")
    return path


SKIP_MESSAGE = ("pfl: skipped (no .venv-pfl; create it with `bash scripts/setup_pfl.sh`, "
                "or point FEDLAB_PFL_PYTHON at a python with pfl 0.6.0 and torch)")


# --- the exported workload ----------------------------------------------------------------------------
def cohorts(fed, cfg: server.RunConfig, rounds: int, clients_per_round=None) -> np.ndarray:
    """[rounds, m]: the clients `simulate` samples in each round (its sampler and stream), in its order."""
    sampler = make_sampler(clients_per_round, fed.num_clients)
    return np.stack([np.asarray(sampler(r, fed.num_clients, rng(cfg.seed, SAMPLE, r))) for r in range(rounds)])


def schedules(fed, cfg: server.RunConfig, rounds: int) -> list[list[np.ndarray]]:
    """schedules[r][k]: client k's batch order in round r (positions within its rows, batches concatenated),
    from the engine's own `local_job`, i.e. what `simulate` trains in that round."""
    return [[np.concatenate(server.local_job(fed, k, cfg, r, None).batches) for k in range(fed.num_clients)]
            for r in range(rounds)]


def export_workload(folder, fed, model_name: str, model_kwargs: dict, model: torch.nn.Module,
                    cfg: server.RunConfig, rounds: int, clients_per_round=None) -> dict:
    """Write what the pfl side needs: meta.json, x/y train and test (.npy), partitions.npz (each client's row
    indices into x_train, concatenated, with offsets; each round's batch order; each round's cohort) and init.pt
    (the model's initial state_dict). Returns the meta."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sched, cohort = schedules(fed, cfg, rounds), cohorts(fed, cfg, rounds, clients_per_round)
    for r in range(rounds):
        for k in range(fed.num_clients):
            if len(sched[r][k]) != len(fed.train_idx[k]) or len(np.unique(sched[r][k])) != len(sched[r][k]):
                raise ValueError("the pfl side trains one epoch of each client's rows: the schedule must be one "
                                 f"permutation of them (round {r}, client {k} is not)")
    sizes = np.array([len(i) for i in fed.train_idx])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    np.savez(folder / "partitions.npz", offsets=offsets, index=np.concatenate(fed.train_idx),
             order=np.stack([np.concatenate(s) for s in sched]), cohorts=cohort)
    ds = fed.dataset
    for name, t in (("x_train", ds.x_train), ("y_train", ds.y_train), ("x_test", fed.x_test), ("y_test", fed.y_test)):
        np.save(folder / f"{name}.npy", t.detach().cpu().numpy())
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, folder / "init.pt")
    meta = dict(model_name=model_name, model_kwargs={k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in model_kwargs.items()},
                input_shape=list(fed.input_shape), num_classes=fed.num_classes, clients=fed.num_clients,
                rounds=rounds, batch=cfg.batch_size, lr=cfg.lr, threads=torch.get_num_threads(),
                rows_per_round=[int(sum(len(sched[r][k]) for k in cohort[r])) for r in range(rounds)])
    (folder / "meta.json").write_text(json.dumps(meta))
    return meta


def run_pfl(folder, python: Path, timeout: float | None = None, device: str = "cpu") -> dict:
    """pfl_side.py on the exported folder, in the pfl environment (one thread as this process has), training on
    `device` (pfl's PFL_PYTORCH_DEVICE)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()), PFL_PYTORCH_DEVICE=device,
               PYTHONWARNINGS="ignore")
    done = subprocess.run([str(python), str(PFL_SIDE), str(folder)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the pfl side failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["theta"] = np.load(Path(folder) / "pfl_theta.npy")
    return out


# --- our side -----------------------------------------------------------------------------------------
def clock(device: str):
    """(CPU s, wall s) now; on a GPU after its queued kernels have finished (else wall time misses them)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.process_time(), time.perf_counter()


def run_ours(fed, model: torch.nn.Module, cfg: server.RunConfig, rounds: int, backend: str,
             clients_per_round=None, device: str = "cpu") -> dict:
    """`simulate` FedAvg for `rounds` rounds from `model`'s weights on `device`; CPU and wall seconds of each
    round (between the ends of consecutive rounds: sampling, local training, messages, aggregation, server
    update; the last round also evaluates), the final test accuracy and weights."""
    stamps = [clock(device)]
    hist = fl.simulate("fedavg", fed, model=copy.deepcopy(model), rounds=rounds, batch_size=cfg.batch_size,
                       lr=cfg.lr, clients_per_round=clients_per_round, eval_every=10**6, backend=backend, progress=False,
                       device=device, callback=lambda r, theta, row: stamps.append(clock(device)))
    return dict(cpu_seconds=[b[0] - a[0] for a, b in zip(stamps, stamps[1:])],
                seconds=[b[1] - a[1] for a, b in zip(stamps, stamps[1:])],
                test_acc=hist.final("test_acc"), theta=hist.theta.detach().cpu().numpy(),
                backend_used=hist.meta["backend_used"])


def timed_rounds(values: list[float]) -> float:
    """Median over the rounds after the warm-up round and before the last (evaluating) one."""
    inner = values[1:-1]
    return float(np.median(inner)) if inner else math.nan


def bench_workload(fed, dataset: str, model_label: str, batch: int, lr: float, rounds: int, backends,
                   pfl: Path | None, flower: bool, clients_per_round=None, device: str = "cpu") -> list[dict]:
    torch.manual_seed(0)
    if model_label == "pfl_simple_cnn":
        model_name, model_kwargs = model_label, {}
        model = SIDE.SimpleCNN(fed.input_shape, fed.num_classes)
    else:
        model_name, model_kwargs = MODELS[model_label]
        model = make_model(model_name, fed.input_shape, fed.num_classes, **model_kwargs)
    cfg = server.RunConfig(batch_size=batch, lr=lr, local_epochs=1)
    load = [os.getloadavg()[0]]
    base = dict(dataset=dataset, model=model_label, params=flatten_params(model).numel(), clients=fed.num_clients,
                cohort=clients_per_round or fed.num_clients, batch=batch, rounds=rounds, threads=torch.get_num_threads(),
                device=device, auto=server.auto_backend(model, device))
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_pfl_") as tmp:
        meta = export_workload(tmp, fed, model_name, model_kwargs, model, cfg, rounds, clients_per_round)
        for b in backends:
            if b == "fused" and linear_layers(model) is None:
                continue
            results[b] = run_ours(fed, model, cfg, rounds, b, clients_per_round, device)
        if pfl is not None:
            results["pfl"] = run_pfl(tmp, pfl, device=device)
            if results["pfl"]["rows_per_round"] != meta["rows_per_round"]:
                raise AssertionError(f"same-work check failed: pfl trained {results['pfl']['rows_per_round']} rows "
                                     f"per round, fedlab_nb {meta['rows_per_round']}")
    load.append(os.getloadavg()[0])
    reference = results.get("loop", next(iter(results.values()), None))
    for b, res in results.items():
        rows.append(dict(base, backend=b, cpu_seconds=timed_rounds(res["cpu_seconds"]),
                         seconds=timed_rounds(res["seconds"]), rows_per_round=meta["rows_per_round"][0],
                         test_acc=res["test_acc"],
                         max_abs_dtheta=float(np.abs(res["theta"] - reference["theta"]).max()),
                         load_avg=max(load)))
    if flower:
        seconds = BB.run_flower(fed, model_name, model_kwargs, batch, lr)
        if seconds is not None:
            rows.append(dict(base, backend="flower", cpu_seconds=math.nan, seconds=seconds,
                             rows_per_round=meta["rows_per_round"][0], test_acc=math.nan, max_abs_dtheta=math.nan,
                             load_avg=os.getloadavg()[0]))
    return rows


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per workload: CPU s of a whole round per backend (Flower: wall s) and pfl's time over each of
    ours (> 1: ours is faster than pfl), our best (`backend='auto'`: fused for MLPs, the loop for conv nets on a
    CPU, else vmap) against pfl, the same-work check (rows per round, test accuracies, the largest weight
    difference of pfl's final model from our loop's, and of our vmap / fused backends' from our loop's: the
    rounding noise that difference compares with), the load. On a GPU the times are wall seconds (CPU seconds of the host process say little there)."""
    key = ["dataset", "model", "clients", "cohort"]
    metric = "cpu_seconds" if (table.get("device", pd.Series(["cpu"])) == "cpu").all() else "seconds"
    out = []
    for k, g in table.groupby(key, sort=False):
        by = g.set_index("backend")
        row = dict(zip(key, k), rows_per_round=int(by["rows_per_round"].iloc[0]))
        for b in ("loop", "vmap", "fused", "pfl"):
            row[f"{b}_s"] = by.loc[b, metric] if b in by.index else math.nan
        row["flower_s_wall"] = by.loc["flower", "seconds"] if "flower" in by.index else math.nan
        best = g["auto"].iloc[0] if "auto" in g else "fused"   # what backend='auto' trains this workload on
        best = "vmap" if best == "fused" and math.isnan(row["fused_s"]) else best   # the fused step runs vmap here
        row["best"] = best
        for b in ("loop", "vmap", "fused"):
            row[f"pfl_over_{b}"] = row["pfl_s"] / row[f"{b}_s"]
        row["best_vs_pfl"] = row["pfl_s"] / row[f"{best}_s"]
        row["flower_over_best"] = row["flower_s_wall"] / by.loc[best, "seconds"] if best in by.index else math.nan
        for b in ("loop", "pfl"):
            row[f"acc_{b}"] = by.loc[b, "test_acc"] if b in by.index else math.nan
        row["pfl_max_abs_dtheta"] = by.loc["pfl", "max_abs_dtheta"] if "pfl" in by.index else math.nan
        ours = [b for b in ("vmap", "fused") if b in by.index and "loop" in by.index]
        row["ours_max_abs_dtheta"] = max((by.loc[b, "max_abs_dtheta"] for b in ours), default=math.nan)
        row["load_avg"] = by["load_avg"].max()
        out.append(row)
    return pd.DataFrame(out)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="digits, 10 clients, a tiny MLP, 3 rounds: seconds (CI)")
    ap.add_argument("--batch", type=positive, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the partitions")
    ap.add_argument("--rounds", type=positive, default=None,
                    help="rounds per side (default 5, --tiny 3): a warm-up, the timed ones, a last evaluated one")
    ap.add_argument("--backends", default="loop,vmap,fused", help="our backends to run")
    ap.add_argument("--models", default=None, help="comma-separated subset of the workloads' models")
    ap.add_argument("--clients", default=None, help="comma-separated subset of the workloads' client counts")
    ap.add_argument("--flower-models", default="mlp-64-32", help="comma-separated models to run on Flower ('none')")
    ap.add_argument("--flower-max-clients", type=whole, default=100)
    ap.add_argument("--headline", choices=["yes", "no", "only"], default="yes",
                    help="pfl-research's headline workload (simple_cnn, 1,000 users, cohort 50; synthetic 32×32×3) "
                         "after bench_backends' workloads (--tiny: 40 users, cohort 5, 8×8×3)")
    ap.add_argument("--no-pfl", action="store_true", help="ours only (what runs when .venv-pfl is absent)")
    ap.add_argument("--device", type=device, default="cpu",
                    help="cpu (default) or cuda: both sides train there; the table then gives wall seconds, no Flower")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    workloads = TINY if args.tiny else FULL
    for option, given, known in (("--models", args.models, {w[3] for w in workloads}),
                                 ("--clients", args.clients, {str(w[2]) for w in workloads}),
                                 ("--backends", args.backends, {"loop", "vmap", "fused"})):
        unknown = [v for v in (given or "").split(",") if given is not None and v not in known]
        if unknown:
            ap.error(f"{option} {','.join(unknown)!r} matches no {'--tiny ' if args.tiny else ''}workload; "
                     f"choose from {','.join(sorted(known))}")
    return args


def main(argv=None) -> pd.DataFrame:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    rounds = args.rounds or (3 if args.tiny else 5)
    if rounds < 3:
        raise SystemExit("--rounds must be at least 3 (a warm-up, a timed round, a last evaluated one)")
    device = args.device
    pfl = None if args.no_pfl else pfl_python()
    if pfl is None and not args.no_pfl:
        print(SKIP_MESSAGE)
    gpu = f"; GPU: {torch.cuda.get_device_name(device)}" if device != "cpu" else ""
    print(f"CPU: {cpu_name()}{gpu}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for dataset, kwargs, m, model_label in ([] if args.headline == "only" else TINY if args.tiny else FULL):
        if (args.models and model_label not in args.models.split(",")) or \
                (args.clients and str(m) not in args.clients.split(",")):
            continue
        fed = fl.federate(dataset, "dirichlet", n_clients=m, alpha=args.alpha, seed=0, test_fraction=0.0,
                          min_size=2, dataset_kwargs=kwargs)
        label = dataset + (f"[{kwargs['max_train'] // 1000}k]" if "max_train" in kwargs else "")
        flower = not args.tiny and device == "cpu" and m <= args.flower_max_clients and model_label in args.flower_models.split(",") \
            and importlib.util.find_spec("flwr") is not None
        new = bench_workload(fed, label, model_label, args.batch, args.lr, rounds, args.backends.split(","), pfl,
                             flower, device=device)
        rows += new
        print(f"{label:>17} {model_label:>11} {m:>5} clients: " + "  ".join(
            f"{r['backend']} {r['cpu_seconds']:.3f}cpu/{r['seconds']:.3f}s acc {r['test_acc']:.3f}" for r in new),
            flush=True)
    if args.headline != "no":
        h = HEADLINE_TINY if args.tiny else HEADLINE
        fed = synthetic_images(h["users"], h["side"], h["rows"])
        label = f"synthetic{h['side']}"
        new = bench_workload(fed, label, "pfl_simple_cnn", args.batch, args.lr, rounds, args.backends.split(","),
                             pfl, False, clients_per_round=h["cohort"], device=device)
        rows += new
        print(f"{label:>17} {'simple_cnn':>11} {h['users']:>5} users, cohort {h['cohort']}: " + "  ".join(
            f"{r['backend']} {r['cpu_seconds']:.3f}cpu/{r['seconds']:.3f}s acc {r['test_acc']:.3f}" for r in new),
            flush=True)
    table = pd.DataFrame(rows)
    summ = summary(table)
    unit = "CPU seconds" if device == "cpu" else f"Wall seconds on {device}"
    print(f"\n{unit} of one whole FedAvg round (median of rounds 2..{rounds - 1} of {rounds}); "
          f"pfl_over_X > 1: X is faster than pfl. Load average at the end {os.getloadavg()[0]:.2f}.")
    print(summ.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "bench_pfl.csv", index=False)
    summ.to_csv(out / "bench_pfl_summary.csv", index=False)
    return table


if __name__ == "__main__":
    main()
