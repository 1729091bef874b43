"""One FedAvg round (1 local epoch) on four backends, same workload, measured in one run:

    loop   clients one after another (engine/client.py)
    vmap   clients vectorised with torch.func (engine/batched.py)
    fused  vmap with the fused Linear-chain SGD step (engine/fused.py; MLPs and logistic regression only)
    flower Flower 1.42 simulation (`run_simulation`), only if `flwr` is importable
    limit  the compute limit: one centralised model trained on the same rows, m·B rows per step
           (the FLOPs of the round with no federation overhead)
    floor  the roofline floor of the round on this machine, max(memory floor, FLOP floor):
           memory: every local step of every client must read and write its own d weights (and its
           optimiser's state) and read its batch, bytes / the bandwidth of a STREAM-like triad measured in the same run;
           FLOPs: forward + backward FLOPs of every row (torch's FlopCounterMode on one batch) / the
           FLOP rate of a large matrix product measured in the same run

    OMP_NUM_THREADS=1 python benchmarks/bench_backends.py [--tiny] [--device cpu|cuda] [--batch 10]
                                  [--client-optimizer sgd|momentum|adam] [--out benchmarks/results]

Against pfl-research (whole rounds, in one run with these backends and Flower): benchmarks/bench_pfl.py.

Prints and writes `bench_backends.csv` (one row per backend and workload), `bench_ratios.csv` and
`bench_backends.png`. Times are the local-training phase of one round (every client of the federation
takes part), the fastest of three after a first untimed one, as in a running simulation (whose rounds also
reuse the rows matrix the backend writes, engine/rows.py); on a shared machine read the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.func import grad_and_value

import fedlab_nb as fl
from fedlab_nb.core import SGD, Adam
from fedlab_nb.engine import server
from fedlab_nb.engine import batched
from fedlab_nb.engine.batched import train_clients_vmap
from fedlab_nb.engine.fused import linear_layers
from fedlab_nb.engine.rows import RoundRows
from fedlab_nb.engine.client import make_loss, train_clients_loop
from fedlab_nb.methods import LocalObjective
from fedlab_nb.models import flatten_params, make_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared argparse types beside this script
from bench_args import device, positive, whole  # noqa: E402

MODELS = {"mlp-64-32": ("mlp", {"hidden": (64, 32)}), "mlp-200-200": ("mlp", {"hidden": (200, 200)}),
          "cnn": ("cnn", {}), "logreg": ("logreg", {}), "mlp-16": ("mlp", {"hidden": (16,)})}
# (dataset, dataset kwargs, clients, model). mnist5k has 4,000 training rows (400 / 40 per client);
# 1,000 clients use Fashion-MNIST: all 60,000 rows for the MLPs, a 20,000-row subset for the CNN (time)
FULL = [("mnist5k", {}, m, model) for m in (10, 100) for model in ("mlp-64-32", "mlp-200-200", "cnn")] + \
       [("fashion_mnist", {}, 1000, model) for model in ("mlp-64-32", "mlp-200-200")] + \
       [("fashion_mnist", {"max_train": 20_000}, 1000, "cnn")]
TINY = [("digits", {}, 4, "logreg"), ("digits", {}, 16, "mlp-16")]
CLIENT_OPTIMIZERS = {"sgd": None, "momentum": SGD(momentum=0.9), "adam": Adam(lr=1e-3)}


# --- measuring --------------------------------------------------------------------------------------
def reset_peak(device: torch.device):
    """Start a fresh peak-memory window: free what we can, then reset VmHWM (Linux) / CUDA peak."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[float, float]:
    """(peak RSS of this process since `reset_peak`, peak CUDA allocation) in MB (NaN if unknown)."""
    rss = math.nan
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) / 1024
    except OSError:
        pass
    cuda = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan
    return rss, cuda


REPEATS = 3   # timed rounds after the first; the fastest is reported


def timed(fn, device: torch.device, repeats: int = REPEATS):
    """(wall seconds, CPU seconds of this process, peak RSS MB, peak CUDA MB) of fn(): the fastest of
    `repeats` calls after a first, untimed one. A simulation calls the backend once per round, so its rounds
    after the first find the allocator's memory already mapped; the first call pays for that (and for
    one-time set-up), and the peak memory window covers it."""
    reset_peak(device)
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return (min(walls), min(cpus), *peak_memory(device))


# --- the backends -----------------------------------------------------------------------------------
def into_reused_rows(kernel):
    """The kernel writing its rows into one matrix reused from call to call when the last call's result is
    gone, as `simulate`'s rounds reuse theirs (engine/rows.py) — for every backend alike."""
    reused = RoundRows()

    def run(loss_fn, theta, jobs, *args, **kwargs):
        return kernel(loss_fn, theta, jobs, *args, out=reused.take("w", len(jobs), theta), **kwargs)
    return run


def run_loop(loss_fn, theta, jobs, lr, device, max_clients, optimizer=None):
    """The loop backend; past `max_clients` it runs that many and scales the time (its cost is a sum
    over clients, so this is exact up to noise)."""
    part, loop = jobs[:max_clients], into_reused_rows(train_clients_loop)
    wall, cpu, rss, cuda = timed(lambda: loop(loss_fn, theta, part, lr, LocalObjective(), optimizer=optimizer), device)
    scale = sum(map(_rows, jobs)) / sum(map(_rows, part))
    return wall * scale, cpu * scale, rss, cuda, len(part) < len(jobs)


def run_vmap(loss_fn, theta, jobs, lr, device, optimizer=None):
    vmapped = into_reused_rows(train_clients_vmap)
    return (*timed(lambda: vmapped(loss_fn, theta, jobs, lr, LocalObjective(), optimizer=optimizer), device), False)


def run_fused(loss_fn, theta, jobs, lr, device, optimizer=None):
    fused = into_reused_rows(batched.train_clients_fused)
    return (*timed(lambda: fused(loss_fn, theta, jobs, lr, LocalObjective(), optimizer=optimizer), device), False)


def run_limit(loss_fn, theta, jobs, lr, device, batch):
    """Centralised SGD over the round's rows (in the clients' batch order), m·B rows per step."""
    x = torch.cat([j.x[torch.as_tensor(np.concatenate(j.batches), device=j.x.device)] for j in jobs]).to(device)
    y = torch.cat([j.y[torch.as_tensor(np.concatenate(j.batches), device=j.y.device)] for j in jobs]).to(device)
    step, rows = grad_and_value(loss_fn), len(jobs) * batch

    def train():
        w = theta.clone()
        for i in range(0, len(y), rows):
            g, _ = step(w, x[i:i + rows], y[i:i + rows])
            w = w - lr * g
        return w
    return (*timed(train, device), False)


def machine_peaks(device: torch.device, n: int = 8_000_000, size: int = 1024, reps: int = 5) -> tuple[float, float]:
    """(bytes/s of a STREAM triad a = b + s·c on float32 arrays of n entries, FLOP/s of a size³ float32
    matrix product), the best of `reps` each: the machine's achievable memory bandwidth and compute rate."""
    b, c = torch.rand(n, device=device), torch.rand(n, device=device)
    a = torch.empty_like(b)
    x, y = torch.rand(size, size, device=device), torch.rand(size, size, device=device)
    best_bw = best_fl = 0.0
    use = 0 if device.type == "cuda" else 1      # CPU time on CPU: steadier when other processes share the cores
    for _ in range(reps):
        t = timed(lambda: torch.add(b, c, alpha=3.0, out=a), device)[use]
        best_bw = max(best_bw, 3 * 4 * n / t)           # read b, c; write a
        t = timed(lambda: torch.mm(x, y), device)[use]
        best_fl = max(best_fl, 2 * size ** 3 / t)
    return best_bw, best_fl


def flops_per_row(loss_fn, theta, job, batch) -> float:
    """Forward + backward FLOPs of one training row (counted by torch on one batch of the model's step)."""
    from torch.utils.flop_counter import FlopCounterMode
    idx = torch.as_tensor(job.batches[0][:batch], device=job.x.device)
    with FlopCounterMode(display=False) as counter:
        grad_and_value(loss_fn)(theta, job.x[idx], job.y[idx])
    return counter.get_total_flops() / len(idx)


def roofline_floor(loss_fn, theta, jobs, batch, device, state_tensors: int = 0) -> dict:
    """The seconds below which no backend can run this round here: max of the memory floor (each client's
    distinct weights, and its optimiser's `state_tensors` buffers of d, read + written at each of its steps,
    plus its rows read once) and the FLOP floor."""
    bandwidth, flop_rate = machine_peaks(device)
    d, features = theta.numel(), jobs[0].x[0].numel()
    steps, rows = sum(len(j.batches) for j in jobs), sum(map(_rows, jobs))
    memory = (steps * 2 * (1 + state_tensors) * d * 4 + rows * features * 4) / bandwidth
    compute = rows * flops_per_row(loss_fn, theta, jobs[0], batch) / flop_rate
    return dict(memory_floor_s=memory, flop_floor_s=compute, floor_s=max(memory, compute),
                bandwidth_gbs=bandwidth / 1e9, gflops=flop_rate / 1e9)


def _rows(job) -> int:
    return sum(len(b) for b in job.batches)


def run_flower(fed, model_name, model_kwargs, batch, lr, rounds=2):
    """Seconds of one FedAvg round in Flower's simulation engine (between the server's evaluations after
    rounds 1 and 2, so start-up is excluded), or None when flwr is not installed."""
    try:
        from flwr.client import ClientApp, NumPyClient
        from flwr.common import ndarrays_to_parameters
        from flwr.server import ServerApp, ServerAppComponents, ServerConfig
        from flwr.server.strategy import FedAvg
        from flwr.simulation import run_simulation
    except ImportError:
        return None
    import logging
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.manual_seed(0)
    net = make_model(model_name, fed.input_shape, fed.num_classes, **model_kwargs)
    m = fed.num_clients

    class Client(NumPyClient):
        def __init__(self, k):
            self.k = k

        def fit(self, parameters, config):
            model = make_model(model_name, fed.input_shape, fed.num_classes, **model_kwargs)
            with torch.no_grad():
                for p, v in zip(model.parameters(), parameters):
                    p.copy_(torch.as_tensor(v))
            x, y = fed.client_train[self.k]
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            for idx in torch.randperm(len(y)).split(batch):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            return [p.detach().numpy() for p in model.parameters()], len(y), {}

    stamps = []

    def evaluate(server_round, parameters, config):
        stamps.append(time.perf_counter())
        return None

    def server_fn(context):
        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=m, min_available_clients=m,
                          evaluate_fn=evaluate,
                          initial_parameters=ndarrays_to_parameters([p.detach().numpy() for p in net.parameters()]))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    client_app = ClientApp(client_fn=lambda context: Client(int(context.node_config["partition-id"])).to_client())
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=client_app, num_supernodes=m,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    return stamps[-1] - stamps[-2] if len(stamps) >= 3 else math.nan


# --- one workload -----------------------------------------------------------------------------------
def bench_workload(fed, dataset, model_label, batch, lr, device, max_loop_clients, flower: bool, optimizer: str = "sgd"):
    model_name, model_kwargs = MODELS[model_label]
    torch.manual_seed(0)
    model = make_model(model_name, fed.input_shape, fed.num_classes, **model_kwargs).to(device)
    theta, loss_fn = flatten_params(model).to(device), make_loss(model)
    cfg = server.RunConfig(batch_size=batch, lr=lr, local_epochs=1)
    jobs = server._local_jobs(fed, np.arange(fed.num_clients), cfg, 0, None)
    m, rows = len(jobs), sum(map(_rows, jobs))
    base = dict(dataset=dataset, model=model_label, params=theta.numel(), clients=m, rows=rows, batch=batch,
                device=str(device), threads=torch.get_num_threads(), optimizer=optimizer)
    opt = CLIENT_OPTIMIZERS[optimizer]
    results = {"loop": run_loop(loss_fn, theta, jobs, lr, device, max_loop_clients, opt),
               "vmap": run_vmap(loss_fn, theta, jobs, lr, device, opt),
               "limit": run_limit(loss_fn, theta, jobs, lr, device, batch)}
    if linear_layers(model) is not None:
        results["fused"] = run_fused(loss_fn, theta, jobs, lr, device, opt)
    out = [dict(base, backend=b, seconds=wall, cpu_seconds=cpu, peak_rss_mb=rss, cuda_peak_mb=cuda, extrapolated=ex)
           for b, (wall, cpu, rss, cuda, ex) in results.items()]
    floor = roofline_floor(loss_fn, theta, jobs, batch, device, 0 if opt is None else len(opt.state_names()))
    out.append(dict(base, backend="floor", seconds=floor["floor_s"], cpu_seconds=floor["floor_s"], peak_rss_mb=math.nan,
                    cuda_peak_mb=math.nan, extrapolated=False, **floor))
    if flower and device.type == "cpu":
        seconds = run_flower(fed, model_name, model_kwargs, batch, lr)
        if seconds is not None:
            out.append(dict(base, backend="flower", seconds=seconds, cpu_seconds=math.nan, peak_rss_mb=math.nan,
                            cuda_peak_mb=math.nan, extrapolated=False))
    return out


def ratios(table: pd.DataFrame, cpu_time: bool) -> pd.DataFrame:
    """Per workload: vmap and fused speed-ups over loop and Flower, and their times over the limit and floor.
    On CPU the loop/vmap/limit ratios use this process's CPU time (steadier than wall time when other
    processes share the cores); Flower runs in worker processes, so its ratio uses wall time."""
    key = ["dataset", "model", "clients"]
    wide = table.pivot_table(index=key, columns="backend", values="cpu_seconds" if cpu_time else "seconds")
    out = pd.DataFrame({"vmap_speedup_over_loop": wide["loop"] / wide["vmap"],
                        "vmap_over_limit": wide["vmap"] / wide["limit"],
                        "vmap_over_floor": wide["vmap"] / wide["floor"]})
    if "fused" in wide:
        out["fused_speedup_over_loop"] = wide["loop"] / wide["fused"]
        out["fused_over_floor"] = wide["fused"] / wide["floor"]
    if "flower" in set(table["backend"]):
        wall = table.pivot_table(index=key, columns="backend", values="seconds")
        out["vmap_speedup_over_flower"] = wall["flower"] / wall["vmap"]
        if "fused" in wall:
            out["fused_speedup_over_flower"] = wall["flower"] / wall["fused"]
    return out.reset_index()


def plot(table: pd.DataFrame, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import seaborn as sns
    grid = sns.catplot(data=table, x="clients", y="clients_per_s", hue="backend", col="model", kind="bar",
                       height=3.2, aspect=1.0,
                       hue_order=[b for b in ("loop", "vmap", "fused", "flower", "limit", "floor") if b in set(table["backend"])])
    grid.set(yscale="log")
    grid.set_axis_labels("clients per round", "clients / s (log)")
    grid.figure.suptitle(f"one FedAvg round, 1 local epoch, batch {table['batch'].iloc[0]}, "
                         f"{table['device'].iloc[0]}, {table['threads'].iloc[0]} thread(s)", y=1.03)
    grid.figure.savefig(path, dpi=120, bbox_inches="tight")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="digits, 4 and 16 clients, tiny models: a few seconds (CI)")
    ap.add_argument("--device", type=device, default="cpu")
    ap.add_argument("--batch", type=positive, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--client-optimizer", choices=sorted(CLIENT_OPTIMIZERS), default="sgd",
                    help="the clients' optimiser on loop, vmap and fused (the limit stays plain SGD)")
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the partitions")
    ap.add_argument("--max-loop-clients", type=positive, default=100,
                    help="time the loop on this many clients and scale to all (its cost is a sum over clients)")
    ap.add_argument("--flower-max-clients", type=whole, default=100,
                    help="run Flower up to this many clients (its simulation engine starts Ray: ~30 s per run)")
    ap.add_argument("--flower-models", default="mlp-64-32", help="comma-separated models to run on Flower")
    ap.add_argument("--models", default=None, help="comma-separated subset of the workloads' models")
    ap.add_argument("--clients", default=None, help="comma-separated subset of the workloads' client counts")
    ap.add_argument("--in-process", action="store_true",
                    help="run every workload in this process (default for --tiny); otherwise each workload gets "
                         "a fresh process, so its peak RSS is its own")
    ap.add_argument("--workload", type=int, default=None, help=argparse.SUPPRESS)  # internal: one workload -> JSON
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return ap.parse_args(argv)


def run_one(args, dataset, kwargs, m, model_label) -> list[dict]:
    device = torch.device(args.device)
    fed = fl.federate(dataset, "dirichlet", n_clients=m, alpha=args.alpha, seed=0, test_fraction=0.0, min_size=2,
                      device=device, dataset_kwargs=kwargs)
    label = dataset + (f"[{kwargs['max_train'] // 1000}k]" if "max_train" in kwargs else "")
    flower = not args.tiny and m <= args.flower_max_clients and model_label in args.flower_models.split(",")
    return bench_workload(fed, label, model_label, args.batch, args.lr, device, args.max_loop_clients, flower,
                          args.client_optimizer)


def run_isolated(argv, i) -> list[dict]:
    """Workload i in a fresh interpreter (its peak RSS is then its own); rows come back as JSON."""
    done = subprocess.run([sys.executable, __file__, *argv, "--workload", str(i)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"workload {i} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> pd.DataFrame:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    workloads = TINY if args.tiny else FULL
    if args.workload is not None:
        print(json.dumps(run_one(args, *workloads[args.workload])))
        return pd.DataFrame()
    device = torch.device(args.device)
    rows = []
    for i, (dataset, kwargs, m, model_label) in enumerate(workloads):
        if (args.models and model_label not in args.models.split(",")) or \
                (args.clients and str(m) not in args.clients.split(",")):
            continue
        new = run_one(args, dataset, kwargs, m, model_label) if args.tiny or args.in_process else run_isolated(argv, i)
        rows += new
        print(f"{new[0]['dataset']:>17} {model_label:>11} {m:>5} clients: " + "  ".join(
            f"{r['backend']} {r['seconds']:.3f}s/{r['cpu_seconds']:.3f}cpu{'*' if r['extrapolated'] else ''} "
            f"({r['peak_rss_mb']:.0f} MB)" for r in new), flush=True)
    table = pd.DataFrame(rows)
    t = table["cpu_seconds"].where(table["cpu_seconds"].notna() & (device.type == "cpu"), table["seconds"])
    table["clients_per_s"] = table["clients"] / t   # on CPU from CPU time (see `ratios`)
    table["rounds_per_s"] = 1 / t
    rat = ratios(table, cpu_time=device.type == "cpu")
    if not args.tiny and importlib.util.find_spec("flwr") is None:
        print("Flower: skipped (flwr is not installed; pip install 'fedlab_nb[flower]')")
    print(table.drop(columns=["device", "threads"], errors="ignore").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(rat.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "bench_backends.csv", index=False)
    rat.to_csv(out / "bench_ratios.csv", index=False)
    if not args.tiny:
        plot(table, out / "bench_backends.png")
    return table


if __name__ == "__main__":
    main()
