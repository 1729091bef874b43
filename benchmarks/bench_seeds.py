"""Seeds as a batch dimension: S FedAvg runs one after another (`simulate` per seed) against the same S runs
trained together (`engine.seeds.simulate_seeds`), measured in one run, CPU time of this process.

    OMP_NUM_THREADS=1 python benchmarks/bench_seeds.py [--seeds 5] [--rounds 10] [--clients 10]
                                                       [--backend vmap] [--out benchmarks/results]

Writes `bench_seeds.csv`. Each run evaluates every round, as the notebooks do (that part is not batched).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

import fedlab_nb as fl
from fedlab_nb.engine.seeds import simulate_seeds

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared argparse types beside this script
from bench_args import backends, positive  # noqa: E402


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=positive, default=5)
    ap.add_argument("--rounds", type=positive, default=10)
    ap.add_argument("--clients", type=positive, default=10)
    ap.add_argument("--dataset", default="mnist5k")
    ap.add_argument("--backends", type=backends, default="vmap,fused")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds))
    fed = lambda s: fl.federate(args.dataset, "dirichlet", n_clients=args.clients, alpha=0.5, seed=s)
    feds = {s: fed(s) for s in seeds}
    method = fl.get_method("fedavg")
    kw = dict(rounds=args.rounds, lr=0.05, batch_size=10, model_kwargs={"hidden": (64, 32)})
    rows = []
    for backend in args.backends.split(","):
        simulate_seeds(method, feds.__getitem__, "mlp", seeds=seeds[:2], **(kw | {"rounds": 1}), backend=backend)  # warm-up
        one_by_one = cpu_seconds(lambda: [fl.simulate(method, feds[s], "mlp", seed=s, progress=False, backend=backend, **kw)
                                          for s in seeds])
        together = cpu_seconds(lambda: simulate_seeds(method, feds.__getitem__, "mlp", seeds=seeds, backend=backend, **kw))
        rows.append(dict(backend=backend, seeds=args.seeds, clients=args.clients, rounds=args.rounds,
                         sequential_cpu_s=one_by_one, batched_cpu_s=together, speedup=one_by_one / together))
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "bench_seeds.csv", index=False)
    return table


if __name__ == "__main__":
    main()
