"""What bounds the fused step: its batched matrix products, timed where they run (one FedAvg round, as in
`bench_backends.py`), against the whole round, the loop's round and the roofline floor; then the rate torch's
kernel gets on the first layer's product as the rows per client grow.

    OMP_NUM_THREADS=1 python benchmarks/bench_products.py [--dataset mnist5k --clients 100 --hidden 200,200]

The products' time is their self time under torch.profiler (wall time, which equals CPU time on a quiet machine;
it includes each product's few µs of dispatch, not the profiler's bookkeeping around the other ops). If the
products alone take longer than a target allows, no change outside them (data movement, dispatch, the Δ write)
can meet it: the kernels themselves have to get faster. Prints a table per product kind and layer, and one JSON
line."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import fedlab_nb as fl
from fedlab_nb.engine import batched, server
from fedlab_nb.engine.client import make_loss
from fedlab_nb.methods import LocalObjective
from fedlab_nb.models import flatten_params, make_model

sys.path.insert(0, str(Path(__file__).parent))
import bench_backends as bench  # noqa: E402  (the sibling script's workload, timing and floor)
from bench_args import positive, positive_list  # noqa: E402

PRODUCTS = {"aten::baddbmm": "forward", "aten::baddbmm_": "update", "aten::bmm": "delta"}


def operands(shapes) -> tuple[list, list]:
    """The two multiplied operands' shapes [a, M, K], [a, K, N] (baddbmm's come after the added tensor)."""
    return (shapes[1], shapes[2]) if len(shapes) > 2 else (shapes[0], shapes[1])


def layer_of(kind: str, left, right) -> str:
    """The Linear layer a product belongs to, as its weight's out×in: forward H·Wᵀ ([.., in] × [.., in, out]),
    update δᵀ·H ([.., out, B] × [.., B, in]), delta δ·W ([.., B, out] × [.., out, in])."""
    out, fan_in = {"forward": (right[2], right[1]), "update": (left[1], right[2]), "delta": (right[1], right[2])}[kind]
    return f"{out}x{fan_in}"


def products_in_place(fused_round, rounds: int) -> list[dict]:
    """Per product kind and layer: CPU ms per round, calls per round and GFLOP/s, from the profiler's self times."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(rounds):
            fused_round()
    totals = defaultdict(lambda: [0.0, 0, 0.0])
    for evt in prof.events():
        if evt.name in PRODUCTS:
            kind, (left, right) = PRODUCTS[evt.name], operands([s for s in evt.input_shapes if s])
            t = totals[kind, layer_of(kind, left, right)]
            t[0] += evt.self_cpu_time_total / 1e6
            t[1] += 1
            t[2] += 2.0 * left[0] * left[1] * left[2] * right[2]
    return [dict(kind=k, layer=layer, ms=1e3 * sec / rounds, calls=n // rounds, gflops=flops / sec / 1e9)
            for (k, layer), (sec, n, flops) in sorted(totals.items(), key=lambda kv: -kv[1][0])]


def kernel_rate(rows: int, fan_in: int, fan_out: int, clients: int = 10, reps: int = 200) -> float:
    """GFLOP/s of the fused forward product for `clients` clients of `rows` rows: [c, rows, in] × W[c, out, in]ᵀ."""
    x, w = torch.randn(clients, rows, fan_in), torch.randn(clients, fan_out, fan_in)
    b = torch.randn(clients, 1, fan_out)
    for _ in range(10):
        torch.baddbmm(b, x, w.transpose(1, 2))
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(reps):
            torch.baddbmm(b, x, w.transpose(1, 2))
        best = min(best, (time.process_time() - start) / reps)
    return 2.0 * clients * rows * fan_in * fan_out / best / 1e9


def workload(args):
    """bench_backends' workload: every client of a Dirichlet(0.5) federation takes one local epoch of FedAvg."""
    fed = fl.federate(args.dataset, "dirichlet", n_clients=args.clients, alpha=0.5, seed=0, test_fraction=0.0,
                      min_size=2)
    torch.manual_seed(0)
    hidden = tuple(int(h) for h in args.hidden.split(","))
    model = make_model("mlp", fed.input_shape, fed.num_classes, hidden=hidden)
    cfg = server.RunConfig(batch_size=args.batch, lr=args.lr, local_epochs=1)
    jobs = server._local_jobs(fed, np.arange(fed.num_clients), cfg, 0, None)
    return fed, hidden, flatten_params(model), make_loss(model), jobs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mnist5k")
    ap.add_argument("--clients", type=positive, default=100)
    ap.add_argument("--hidden", type=positive_list, default="200,200")
    ap.add_argument("--batch", type=positive, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--rounds", type=positive, default=3, help="rounds under the profiler")
    ap.add_argument("--max-loop-clients", type=positive, default=100)
    ap.add_argument("--rows", type=positive_list, default="10,16,32,64,128", help="rows per client for the kernel-rate sweep")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    fed, hidden, theta, loss_fn, jobs = workload(args)
    loop_s = bench.run_loop(loss_fn, theta, jobs, args.lr, device, args.max_loop_clients)[1]
    fused_s = bench.run_fused(loss_fn, theta, jobs, args.lr, device)[1]
    floor = bench.roofline_floor(loss_fn, theta, jobs, args.batch, device)
    fused = bench.into_reused_rows(batched.train_clients_fused)
    fused_round = lambda: fused(loss_fn, theta, jobs, args.lr, LocalObjective())  # noqa: E731
    fused_round()
    table = products_in_place(fused_round, args.rounds)
    products_s = sum(r["ms"] for r in table) / 1e3

    print(f"{args.dataset}, {args.clients} clients, MLP {args.hidden}, batch {args.batch}; CPU s of one round:")
    print(f"  loop {loop_s:.4f}   fused {fused_s:.4f} ({loop_s / fused_s:.1f}x the loop)   "
          f"floor {floor['floor_s']:.4f}")
    print(f"  the fused round's products alone: {products_s:.4f} s ({products_s / fused_s:.0%} of it); "
          f"10x the loop needs {loop_s / 10:.4f} s, 2x the floor {2 * floor['floor_s']:.4f} s")
    print(f"  {'product':8} {'layer (out x in)':>16} {'ms/round':>9} {'calls':>6} {'GFLOP/s':>8}")
    for r in table:
        print(f"  {r['kind']:8} {r['layer']:>16} {r['ms']:9.2f} {r['calls']:6d} {r['gflops']:8.1f}")
    fan_in = int(np.prod(fed.input_shape))
    sweep = {m: kernel_rate(m, fan_in, hidden[0]) for m in map(int, args.rows.split(","))}
    print(f"  first-layer forward, 10 clients × M rows × {fan_in} → {hidden[0]}: " +
          ", ".join(f"M={m} {g:.0f}" for m, g in sweep.items()) + f" GFLOP/s; 1024³ product {floor['gflops']:.0f}")
    result = dict(dataset=args.dataset, clients=args.clients, hidden=args.hidden, batch=args.batch,
                  loop_s=loop_s, fused_s=fused_s, floor_s=floor["floor_s"], products_s=products_s,
                  peak_gflops=floor["gflops"], products=table, forward_rate_by_rows=sweep)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
