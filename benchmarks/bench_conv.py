"""Can a conv net's local SGD step be batched across clients faster than pfl-research's one-client-at-a-time loop?
(issue 43, item 3). One local SGD step (forward, backward, update) of every client, each on its own weights and
its own batch of B rows, timed five ways on the same clients and batches:

  (a) pfl   pfl's way: one eager module, clients one after another: load the client's weights, forward,
            backward, torch.optim.SGD.step() (what pfl's `PyTorchModel` does per local step)
  (b) vmap  our vmap backend's step: torch.func.vmap of grad over the per-client weights (grouped convolutions)
  (c) unfold  batched without vmap: per-client weights [C, out, in·k·k], convolution as im2col (F.unfold) +
            batched product (baddbmm), pooling and dense layers batched, autograd over that
  (d) grouped / grouped_cl  batched without vmap: all clients' channels side by side, one grouped convolution
            (groups = C) per layer, autograd; NCHW and channels-last (oneDNN) memory formats
  (e) limit / limit_cl / limit_cl_100  the compute limit: one model (no per-client weights), the same C·B rows
            as one batch (one step; a plain convolution of batch C·B), NCHW and channels-last, and channels-last
            in pieces of 100 rows (one step per piece: the activations stay in cache)
  a_pfl_cl  for reference: (a) with the module in channels-last (what pfl's loop would get from NHWC kernels)

    OMP_NUM_THREADS=1 python benchmarks/bench_conv.py                 # both models (≈ 2.5 min CPU on one core)
    OMP_NUM_THREADS=1 python benchmarks/bench_conv.py --models cnn --reps 5
    python benchmarks/bench_conv.py --tiny                            # seconds; tests/test_bench_conv.py

Models: fedlab_nb's `cnn` on 28×28×1 (mnist5k; two 5×5 conv 16/32 + pool, dense 128) at 100 clients, and
pfl-research's `simple_cnn` (benchmarks/pfl_side.py: 3×3 conv 32, 3×3 conv 64, pool, dense 128) on 32×32×3
at 50 clients (its headline cohort); B = 10 rows a client, random inputs. The variants run alternately, `--reps`
times, after one warm-up call each; the table gives the median CPU seconds of one step of all clients, the
speed-up over (a), the GFLOP/s (the step's FLOPs counted by torch's FlopCounterMode on (a): forward + backward,
without the first layer's input gradient, which autograd skips) and, for (b)-(d), the largest difference of the
clients' gradients from (a)'s beside the largest gradient entry (clients on different weights: float rounding
only). `uptime` and a 1024³ GEMM's rate are printed at the start and the end: ratios within one run count.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value, vmap
from torch.utils.flop_counter import FlopCounterMode

from fedlab_nb.engine.batched import make_masked_loss
from fedlab_nb.models import make_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the shared argparse types beside this script
from bench_args import positive  # noqa: E402
LR = 0.05


def pfl_simple_cnn(shape, classes):
    spec = importlib.util.spec_from_file_location("pfl_side", HERE / "pfl_side.py")   # numpy and torch only
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SimpleCNN(shape, classes)


WORKLOADS = {   # name: (model factory, input shape, clients)
    "cnn": (lambda s, k: make_model("cnn", s, k), (1, 28, 28), 100),
    "simple_cnn": (pfl_simple_cnn, (3, 32, 32), 50),
    "cnn_tiny": (lambda s, k: make_model("cnn", s, k), (1, 8, 8), 4),     # --tiny: a check that it runs
    "simple_cnn_tiny": (pfl_simple_cnn, (3, 8, 8), 3),
}


def layers_of(model: nn.Module):
    """The model's layers in order (features then head), with their parameter names."""
    out = []
    for prefix in ("features", "head"):
        for i, m in enumerate(getattr(model, prefix)):
            out.append((m, f"{prefix}.{i}"))
    return out


# --- (c): im2col + batched products, per-client weights ----------------------------------------------------
def forward_unfold(model, P, x):
    """Logits [C, B, classes] of C clients with weights P (name → [C, *shape]) on x [C, B, c, h, w]."""
    C, B = x.shape[:2]
    h = x.reshape(C * B, *x.shape[2:])                  # [C·B, ch, H, W], client-major
    for m, name in layers_of(model):
        if isinstance(m, nn.Conv2d):
            k, p = m.kernel_size[0], m.padding[0]
            H, W = h.shape[2:]
            Ho, Wo = H + 2 * p - k + 1, W + 2 * p - k + 1
            cols = F.unfold(h, k, padding=p)                                  # [C·B, ch·k·k, L]
            cols = cols.view(C, B, -1, Ho * Wo).transpose(1, 2).reshape(C, -1, B * Ho * Wo)
            w = P[f"{name}.weight"].reshape(C, m.out_channels, -1)           # [C, out, ch·k·k]
            z = torch.baddbmm(P[f"{name}.bias"].unsqueeze(2), w, cols)        # [C, out, B·L]
            h = z.view(C, m.out_channels, B, Ho, Wo).transpose(1, 2).reshape(C * B, m.out_channels, Ho, Wo)
        elif isinstance(m, nn.ReLU):
            h = h.relu()
        elif isinstance(m, nn.MaxPool2d):
            h = F.max_pool2d(h, m.kernel_size)
        elif isinstance(m, nn.Flatten):
            h = h.reshape(C, B, -1)
        elif isinstance(m, nn.Linear):
            h = torch.baddbmm(P[f"{name}.bias"].unsqueeze(1), h, P[f"{name}.weight"].transpose(1, 2))
        else:
            raise TypeError(type(m))
    return h


# --- (d): one grouped convolution over all clients' channels ------------------------------------------------
def forward_grouped(model, P, x, channels_last=False):
    """Logits [C, B, classes]; activations [B, C·ch, H, W] (clients' channels side by side), groups = C."""
    C, B = x.shape[:2]
    h = x.transpose(0, 1).reshape(B, -1, *x.shape[3:])   # [B, C·c, H, W]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    h = h.contiguous(memory_format=fmt)
    for m, name in layers_of(model):
        if isinstance(m, nn.Conv2d):
            w = P[f"{name}.weight"].reshape(C * m.out_channels, *m.weight.shape[1:]).contiguous(memory_format=fmt)
            h = F.conv2d(h, w, P[f"{name}.bias"].reshape(-1), padding=m.padding, groups=C)
        elif isinstance(m, nn.ReLU):
            h = h.relu()
        elif isinstance(m, nn.MaxPool2d):
            h = F.max_pool2d(h, m.kernel_size)
        elif isinstance(m, nn.Flatten):
            h = h.reshape(B, C, -1).transpose(0, 1)   # [C, B, ch·h·w], each client's (c, h, w) order (any layout)
        elif isinstance(m, nn.Linear):
            h = torch.baddbmm(P[f"{name}.bias"].unsqueeze(1), h, P[f"{name}.weight"].transpose(1, 2))
        else:
            raise TypeError(type(m))
    return h


def batched_step(forward, model, P, x, y, lr, **kw):
    """One SGD step of all clients with autograd over `forward`; P's tensors are updated in place.
    Returns the gradients (for the check)."""
    for p in P.values():
        p.grad = None
    logits = forward(model, P, x, **kw)
    C, B = y.shape
    loss = F.cross_entropy(logits.reshape(C * B, -1), y.reshape(-1), reduction="sum") / B   # Σ_k mean_k
    loss.backward()
    with torch.no_grad():
        for p in P.values():
            p.sub_(p.grad, alpha=lr)
    return {n: p.grad for n, p in P.items()}


# --- (b): the vmap backend's step ------------------------------------------------------------------------------
def make_vmap_step(model):
    """The vmap backend's step (engine/batched.py `_client_step` without an objective term): vmap over clients of
    grad of the masked loss, then w ← w − η g per parameter stack."""
    batched_grad = vmap(grad_and_value(make_masked_loss(model)), in_dims=(0, 0, 0, 0))

    def step(P, x, y, mask, lr):
        g, _ = batched_grad(P, x.reshape(*x.shape[:2], -1), y, mask)
        for n, p in P.items():
            p.sub_(g[n], alpha=lr)
        return g
    return step


# --- (a): pfl's loop ---------------------------------------------------------------------------------------------
def pfl_step(model, opt, P, x, y, lr, keep=False, channels_last=False):
    """Clients one after another on one eager module: load client k's weights, forward, backward, SGD step, and
    (as pfl keeps the trained local model until the user is done) store them back."""
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    grads = {n: [] for n in names} if keep else None
    for k in range(x.shape[0]):
        with torch.no_grad():
            for n, p in zip(names, params):
                p.copy_(P[n][k])
        opt.zero_grad(set_to_none=True)
        xk = x[k].contiguous(memory_format=torch.channels_last) if channels_last else x[k].reshape(x.shape[1], -1)
        F.cross_entropy(model.head(model.features(xk)) if channels_last else model(xk), y[k]).backward()
        if keep:
            for n, p in zip(names, params):
                grads[n].append(p.grad.clone())
        opt.step()
        with torch.no_grad():
            for n, p in zip(names, params):
                P[n][k].copy_(p)
    return None if grads is None else {n: torch.stack(v) for n, v in grads.items()}


def limit_step(model, opt, x, y, channels_last=False, rows=None):
    """(e) one model, one step on all C·B rows (or `rows` rows at a time: one step per piece)."""
    xb, yb = x.reshape(-1, *x.shape[2:]), y.reshape(-1)
    if channels_last:
        xb = xb.contiguous(memory_format=torch.channels_last)
    rows = rows or len(yb)
    for lo in range(0, len(yb), rows):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model.head(model.features(xb[lo:lo + rows])), yb[lo:lo + rows]).backward()
        opt.step()


def gemm_rate(n: int = 1024, reps: int = 5) -> float:
    """GFLOP/s of an n³ float32 matrix product (this core's large-GEMM rate; CPU time, best of reps)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2 * n ** 3 / best / 1e9


def step_flops(model, x, y) -> float:
    """FLOPs of one client's forward + backward (FlopCounterMode), times the clients."""
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x[0].reshape(x.shape[1], -1)), y[0]).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() * x.shape[0]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def run(name: str, reps: int, batch: int, seed: int = 0) -> list[dict]:
    factory, shape, C = WORKLOADS[name]
    torch.manual_seed(seed)
    model = factory(shape, 10)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(C, batch, *shape)
    y = torch.randint(0, 10, (C, batch))
    mask = torch.ones(C, batch)

    def stacks(noise=0.0):   # every client's weights: θ (plus a per-client perturbation for the check)
        return {n: (t.expand(C, *t.shape) + noise * torch.randn(C, *t.shape)).contiguous() for n, t in theta.items()}

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    vstep = make_vmap_step(model)
    variants = {
        "a_pfl": lambda P: pfl_step(model, opt, P, x, y, LR),
        "b_vmap": lambda P: vstep(P, x, y, mask, LR),
        "c_unfold": lambda P: batched_step(forward_unfold, model, P, x, y, LR),
        "d_grouped": lambda P: batched_step(forward_grouped, model, P, x, y, LR),
        "d_grouped_cl": lambda P: batched_step(forward_grouped, model, P, x, y, LR, channels_last=True),
    }

    # the check: every batched variant's gradients against pfl's, clients with different weights
    P0 = stacks(noise=0.01)
    ref = pfl_step(model, opt, {n: p.clone() for n, p in P0.items()}, x, y, LR, keep=True)
    diffs, scale = {"a_pfl": 0.0}, {}
    for key in ("b_vmap", "c_unfold", "d_grouped", "d_grouped_cl"):
        P = {n: p.clone().requires_grad_(key != "b_vmap") for n, p in P0.items()}
        if key == "b_vmap":
            g = vstep(P, x, y, mask, LR)
        else:
            g = {n: t.clone() for n, t in variants[key](P).items()}
        diffs[key] = max(float((g[n] - ref[n]).abs().max()) for n in ref)
        scale[key] = max(float(ref[n].abs().max()) for n in ref)

    limit_model = factory(shape, 10)
    limit_opt = torch.optim.SGD(limit_model.parameters(), lr=LR)
    limit_cl = factory(shape, 10).to(memory_format=torch.channels_last)
    limit_cl_opt = torch.optim.SGD(limit_cl.parameters(), lr=LR)
    variants["e_limit"] = lambda P: limit_step(limit_model, limit_opt, x, y)
    variants["e_limit_cl"] = lambda P: limit_step(limit_cl, limit_cl_opt, x, y, channels_last=True)
    variants["e_limit_cl_100"] = lambda P: limit_step(limit_cl, limit_cl_opt, x, y, channels_last=True, rows=100)
    # for reference: pfl's loop with the module in channels-last (oneDNN's NHWC convolutions and pooling)
    pfl_cl = factory(shape, 10).to(memory_format=torch.channels_last)
    pfl_cl_opt = torch.optim.SGD(pfl_cl.parameters(), lr=LR)
    variants["a_pfl_cl"] = lambda P: pfl_step(pfl_cl, pfl_cl_opt, P, x.contiguous(), y, LR, channels_last=True)
    for k in ("e_limit", "e_limit_cl", "e_limit_cl_100", "a_pfl_cl"):
        diffs[k] = float("nan")

    flops = step_flops(model, x, y)
    state = {k: stacks() for k in variants}
    for k in ("c_unfold", "d_grouped", "d_grouped_cl"):
        for p in state[k].values():
            p.requires_grad_(True)
    times = {k: [] for k in variants}
    for k, f in variants.items():   # warm-up
        f(state[k])
    for _ in range(reps):           # alternating
        for k, f in variants.items():
            t0 = time.process_time()
            f(state[k])
            times[k].append(time.process_time() - t0)
    base = statistics.median(times["a_pfl"])
    rows = []
    for k in variants:
        t = statistics.median(times[k])
        rows.append(dict(model=name, clients=C, batch=batch, variant=k, step_s=round(t, 5),
                         speedup_vs_pfl=round(base / t, 3), gflops=round(flops / t / 1e9, 1),
                         max_abs_dgrad=diffs[k], max_abs_grad=scale.get(k, float("nan")),
                         step_gflop=round(flops / 1e9, 3)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,simple_cnn")
    ap.add_argument("--reps", type=positive, default=5)
    ap.add_argument("--batch", type=positive, default=10)
    ap.add_argument("--tiny", action="store_true", help="8×8 images, 3-4 clients, one rep (not a measurement)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.reps = "cnn_tiny,simple_cnn_tiny", 1
    print(f"start: {uptime()}; 1024³ GEMM {gemm_rate():.0f} GFLOP/s")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    rows = []
    for name in args.models.split(","):
        rows += run(name, args.reps, args.batch)
    print(f"end:   {uptime()}; 1024³ GEMM {gemm_rate():.0f} GFLOP/s; step GFLOP: "
          + ", ".join(f"{r['model']} {r['step_gflop']}" for r in rows if r["variant"] == "a_pfl"))
    head = f"{'model':<11}{'C':>5}{'variant':>16}{'step s':>10}{'vs pfl':>8}{'GFLOP/s':>9}{'max|Δgrad|':>12}{'max|grad|':>11}"
    print(head)
    for r in rows:
        print(f"{r['model']:<11}{r['clients']:>5}{r['variant']:>16}{r['step_s']:>10.4f}{r['speedup_vs_pfl']:>7.2f}×"
              f"{r['gflops']:>9.1f}{r['max_abs_dgrad']:>12.1e}{r['max_abs_grad']:>11.1e}")
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
