"""Scale: one FedAvg round with 10,000 clients of the 784-64-32-10 MLP on Fashion-MNIST (60,000 rows, IID,
6 rows per client), every client taking part, on the vmap and fused backends: seconds and peak RSS.

    OMP_NUM_THREADS=1 python benchmarks/bench_scale.py [--clients 10000] [--rounds 2] [--backend fused]

Each backend runs in a fresh interpreter so its peak RSS (VmHWM) is its own; the vmap kernel streams the
clients through memory-bounded chunks (engine/batched.py `MEMORY_BUDGET`), the client store stays on the CPU.
Writes `bench_scale.csv`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared argparse types beside this script
from bench_args import backends, positive  # noqa: E402


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(backend: str, clients: int, rounds: int) -> dict:
    import fedlab_nb as fl
    fed = fl.federate("fashion_mnist", "iid", n_clients=clients, seed=0, test_fraction=0.0)
    start, cpu = time.perf_counter(), time.process_time()
    hist = fl.simulate("fedavg", fed, "mlp", model_kwargs={"hidden": (64, 32)}, rounds=rounds, clients_per_round=None,
                       batch_size=10, lr=0.05, progress=False, backend=backend, eval_every=rounds)
    return dict(backend=backend, clients=clients, rounds=rounds, seconds=time.perf_counter() - start,
                cpu_seconds=time.process_time() - cpu, seconds_per_round=(time.perf_counter() - start) / rounds,
                test_acc=float(hist["test_acc"].iloc[-1]), peak_rss_mb=peak_rss_mb(),
                backend_used=hist.meta["backend_used"])


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=positive, default=10_000)
    ap.add_argument("--rounds", type=positive, default=2)
    ap.add_argument("--backends", type=backends, default="vmap,fused")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one backend in this process -> JSON
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.clients, args.rounds)))
        return pd.DataFrame()
    rows = []
    for backend in args.backends.split(","):
        done = subprocess.run([sys.executable, __file__, "--one", backend, "--clients", str(args.clients),
                               "--rounds", str(args.rounds)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "bench_scale.csv", index=False)
    return table


if __name__ == "__main__":
    main()
