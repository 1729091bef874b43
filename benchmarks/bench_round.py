"""Seconds per whole `simulate` round (sampling, local training, messages, aggregation; evaluation off),
for a before/after comparison of the engine: run it once per checkout, alternating, on one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python benchmarks/bench_round.py [--model mlp] [--clients 100]

Prints one JSON line {"seconds_per_round": min over repeats, ...}. `benchmarks/README.md` has the table."""
from __future__ import annotations

import argparse
import json
import time

import torch

import fedlab_nb as fl

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="mlp")
ap.add_argument("--hidden", default="64,32")
ap.add_argument("--clients", type=int, default=100)
ap.add_argument("--backend", default="vmap")
ap.add_argument("--repeats", type=int, default=5)
args = ap.parse_args()
torch.set_num_threads(1)
fed = fl.federate("mnist5k", "dirichlet", n_clients=args.clients, alpha=0.5, seed=0)
kw = {"hidden": tuple(int(h) for h in args.hidden.split(","))} if args.model == "mlp" else {}
best = float("inf")
for _ in range(args.repeats):
    t0 = time.perf_counter()
    fl.simulate("fedavg", fed, model=args.model, model_kwargs=kw, rounds=2, batch_size=10, lr=0.05,
                eval_every=10**6, backend=args.backend, progress=False)  # evaluates only the last round
    best = min(best, (time.perf_counter() - t0) / 2)
print(json.dumps({"engine": fl.__file__, "model": args.model, "hidden": args.hidden, "clients": args.clients,
                  "backend": args.backend, "seconds_per_round": round(best, 4)}))
