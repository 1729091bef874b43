"""Our `loop` backend's round against a bare torch loop on the same clients (issue 43, item 2): is there per-step
overhead left in the loop, beside pfl-research's own?

The bare loop is what pfl-research's `PyTorchModel` does per local step and nothing else: one eager module, each
client's weights loaded into it, then per batch of 10 rows a forward, `backward()` (or `autograd.grad`) and an
SGD step. Ours is round 2 of `simulate("fedavg", backend="loop")` (sampling, the batch schedule, local training,
the aggregation and the server update; round 2 so that neither set-up nor the final evaluation is timed). Both
train every client of pfl's headline `simple_cnn` workload (synthetic 32×32×3 images, 50 users of about 50 rows:
benchmarks/bench_pfl.py) from the same weights; CPU seconds, alternating, min of `--repeats`.

    OMP_NUM_THREADS=1 python benchmarks/loop_vs_torch.py             # ≈ 1 min CPU on one core
    python benchmarks/loop_vs_torch.py --tiny                        # seconds (tests/test_bench_pfl.py)
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pfl as B  # noqa: E402  (the workload and pfl's model)

import fedlab_nb as fl  # noqa: E402


def ours(fed, model, batch: int) -> float:
    """CPU seconds of round 2 of FedAvg on the loop backend, every client taking part."""
    stamps = []
    fl.simulate("fedavg", fed, model=copy.deepcopy(model), rounds=3, batch_size=batch, lr=0.05, eval_every=10**6,
                backend="loop", progress=False, callback=lambda r, theta, row: stamps.append(time.process_time()))
    return stamps[1] - stamps[0]


def bare(fed, model, batch: int, backward: bool = True) -> float:
    """CPU seconds of one pass of a bare eager loop over every client's rows in order, batch by batch."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    start = time.process_time()
    theta = [p.detach().clone() for p in params]
    for x, y in fed.client_train:
        with torch.no_grad():
            for p, t in zip(params, theta):
                p.copy_(t)
        for i in range(0, len(x), batch):
            loss = F.cross_entropy(m(x[i:i + batch]), y[i:i + batch])
            if backward:
                for p in params:
                    p.grad = None
                loss.backward()
                grads = [p.grad for p in params]
            else:
                grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                torch._foreach_sub_(params, torch._foreach_mul(grads, 0.05))
    return time.process_time() - start


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="8×8 images, 6 users: a check that it runs")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    side, users, rows = (8, 6, 12) if args.tiny else (32, 50, 50)
    fed = B.synthetic_images(users=users, side=side, rows=rows)
    torch.manual_seed(0)
    model = B.SIDE.SimpleCNN(fed.input_shape, fed.num_classes)
    runs = {"ours": lambda: ours(fed, model, 10), "bare_backward": lambda: bare(fed, model, 10, True),
            "bare_grad": lambda: bare(fed, model, 10, False)}
    times = {name: [] for name in runs}
    for _ in range(max(args.repeats, 1)):
        for name, run in runs.items():
            times[name].append(run())
    best = {name: min(t) for name, t in times.items()}
    rows_total = sum(len(y) for _, y in fed.client_train)
    print(f"{users} users, {rows_total} rows, batch 10, {torch.get_num_threads()} thread(s); CPU s (min of "
          f"{args.repeats}): " + ", ".join(f"{k} {v:.3f}" for k, v in best.items()) +
          f"; ours ÷ bare_backward {best['ours'] / best['bare_backward']:.2f}")
    return best


if __name__ == "__main__":
    main()
