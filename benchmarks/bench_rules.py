"""Time every robust aggregation rule on n clients × d parameters (default 100 × 1e5, float32).

    OMP_NUM_THREADS=1 python benchmarks/bench_rules.py [--n 100] [--d 100000] [--f 10] [--repeats 3] [--device cpu]

Prints one row per rule: best-of-`repeats` wall and process-CPU seconds, and the wall-time ratio to the
plain mean. On shared cores the CPU column is the fairer one.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

from fedlab_nb.methods.robustness.rules import get_rule

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared argparse types beside this script
from bench_args import device, positive, whole  # noqa: E402

CASES = {
    "mean": ("mean", {}),
    "coordinate_median": ("coordinate_median", {}),
    "trimmed_mean(0.1)": ("trimmed_mean", {"beta": 0.1}),
    "krum": ("krum", {"f": None}),
    "multi_krum": ("multi_krum", {"f": None}),
    "bulyan": ("bulyan", {"f": None}),
    "geometric_median": ("geometric_median", {}),
    "centered_clip(L=3)": ("centered_clip", {"tau": 1.0, "iters": 3}),
    "flag_aggregator(r=1)": ("flag_aggregator", {"iters": 5}),
    "flag_aggregator(r=3,λ=1)": ("flag_aggregator", {"r": 3, "lam": 1.0, "iters": 5}),
    "gas(median, p=64)": ("gas", {"base_rule": "coordinate_median", "p": 64, "f": None}),
    "gas(krum, p=64)": ("gas", {"base_rule": "krum", "p": 64, "f": None}),
    "fltrust": ("fltrust", {"server_update": None}),
}


def best_time(fn, repeats: int, device: str) -> tuple[float, float]:
    """Best wall-clock and best process-CPU seconds over ``repeats`` calls (CPU time is less distorted
    when other processes share the cores)."""
    wall, cpu = [], []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive, default=100)
    ap.add_argument("--d", type=positive, default=100_000)
    ap.add_argument("--f", type=whole, default=10, help="Byzantine count for Krum/Bulyan/GAS (Bulyan needs n >= 4f+3)")
    ap.add_argument("--repeats", type=positive, default=3)
    ap.add_argument("--device", type=device, default="cpu")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, args.d, generator=g).to(args.device)
    x[: args.f] *= 100.0  # a few outliers so the robust rules have something to do
    server_update = x[args.f:].mean(0)
    print(f"{args.n} clients × {args.d:,} parameters, float32, device={args.device}, "
          f"threads={torch.get_num_threads()}, f={args.f}, best of {args.repeats}")
    print(f"{'rule':<26}{'wall s':>10}{'cpu s':>10}{'× mean':>10}")
    base = None
    for label, (name, hyper) in CASES.items():
        hyper = {k: (args.f if k == "f" else server_update if k == "server_update" else v) for k, v in hyper.items()}
        rule = get_rule(name, **hyper)
        rule(x)  # warm-up
        wall, cpu = best_time(lambda: rule(x), args.repeats, args.device)
        base = base or wall
        print(f"{label:<26}{wall:>10.4f}{cpu:>10.4f}{wall / base:>10.1f}")


if __name__ == "__main__":
    main()
