"""Seconds per whole `simulate` round (sampling, local training, messages, aggregation; evaluation off),
for a before/after comparison of the engine: run it once per checkout, alternating, on one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python benchmarks/bench_round.py [--model mlp] [--clients 100]

Small rounds show the engine's per-round overhead (sampling, batch schedules, chunk planning), e.g. 15 clients,
one local step of batch 16 on digits with logistic regression, 150 rounds:
    ... bench_round.py --dataset digits --model logreg --clients 15 --local-steps 1 --batch-size 16 --rounds 150

Prints one JSON line {"seconds_per_round": min over repeats, ...}. `benchmarks/README.md` has the table."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import fedlab_nb as fl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared argparse types beside this script
from bench_args import positive, positive_list  # noqa: E402
from fedlab_nb.data.datasets import DATASETS  # noqa: E402


ap = argparse.ArgumentParser()
ap.add_argument("--model", choices=["logreg", "mlp", "cnn", "mlp_bn", "cnn_bn"], default="mlp")
ap.add_argument("--hidden", type=positive_list, default="64,32")
ap.add_argument("--clients", type=positive, default=100)
ap.add_argument("--backend", choices=["loop", "vmap", "fused", "auto"], default="vmap")
ap.add_argument("--repeats", type=positive, default=5)
ap.add_argument("--dataset", choices=sorted(DATASETS), default="mnist5k")
ap.add_argument("--rounds", type=positive, default=2)
ap.add_argument("--batch-size", type=positive, default=10)
ap.add_argument("--local-steps", type=positive, default=None, help="steps per round (default: one epoch)")
args = ap.parse_args()
torch.set_num_threads(1)
fed = fl.federate(args.dataset, "dirichlet", n_clients=args.clients, alpha=0.5, seed=0)
kw = {"hidden": tuple(int(h) for h in args.hidden.split(","))} if args.model == "mlp" else {}
best = best_cpu = float("inf")  # wall and this process's CPU seconds (steadier on a shared machine)
for _ in range(args.repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    fl.simulate("fedavg", fed, model=args.model, model_kwargs=kw, rounds=args.rounds, batch_size=args.batch_size,
                local_steps=args.local_steps, lr=0.05, eval_every=10**6, backend=args.backend,
                progress=False)  # evaluates only the last round
    best = min(best, (time.perf_counter() - t0) / args.rounds)
    best_cpu = min(best_cpu, (time.process_time() - c0) / args.rounds)
print(json.dumps({"engine": fl.__file__, "dataset": args.dataset, "model": args.model, "hidden": args.hidden,
                  "clients": args.clients, "rounds": args.rounds,
                  "backend": args.backend, "seconds_per_round": round(best, 6),
                  "cpu_seconds_per_round": round(best_cpu, 6)}))  # µs: rounds of 2 ms
