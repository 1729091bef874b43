"""Bit-width heterogeneous FL — Yoon, Park, Jeong, Hwang, "Bitwidth Heterogeneous Federated Learning with
Progressive Weight Dequantization" (ProWD), ICML 2022 (https://arxiv.org/abs/2202.11453). No official code is known.

The setting (BHFL, from the abstract): devices compute and store weights at different bit-widths b (here
{2, 4, 8, 32}). A b-bit client receives the global model re-quantised to its grid, Q_b(θ), trains it with
quantisation-aware training (forward on Q_b(w), straight-through gradients, `quantize.py`), and uploads
Q_b(w) (its storage format, one R per layer). The server sees the dequantised grid values.

Aggregators here:
- `naive`: FedAvg over the grid values of every client (what the abstract says degrades high-bit models);
- `grouped`: one FedAvg model per bit-width (the abstract's "naive approach"): a run per group, `group_sampler`;
- `fp32_only`: FedAvg over the 32-bit clients only, broadcast to everyone (for the 32-bit clients the same
  model as the 32-bit group of `grouped`);
- `prowd_lite` — OUR SIMPLIFICATION, not the paper's ProWD: the paper's trainable, progressive dequantiser (the
  review's "two loss terms") and its selective aggregation rule could not be read offline. ProWD-lite keeps the
  idea of a server-side dequantiser fitted on pairs the server builds from the full-precision clients: per layer
  and bit-width b, f_b(ℓ) = R · E[w/R | Q_b(w) = ℓ] over the 32-bit clients' uploaded weights w (the least-squares,
  i.e. MSE-optimal, dequantiser of a level: the centroid of its bin), applied to every b-bit upload before the
  size-weighted average. Levels no 32-bit weight falls in keep their grid value. There is no progressive chain
  (with a level-only input, b → 2b → … → 32 stages of conditional means collapse to the direct map by the tower
  property, up to double-rounding) and no selective aggregation.

Random stream "prowd" = 67: the stochastic rounding of uploads (option `stochastic=True`; default nearest).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.func import grad_and_value

from ...core.messages import Transform
from ...core.registry import register
from ...core.streams import register_stream
from ...engine.evaluate import evaluate
from ...models import param_spec
from .quantize import FULL_PRECISION, check_bits, dequantize, fake_quantize_flat, is_bias, layer_slices, levels, \
    model_bytes, quantize_flat, quantize_levels
from ...utils import rng
from ...core.method import DataSizeWeighting, Method, OwnTraining, ServerSGD, weighted_mean

PROWD = register_stream("prowd", 67)
BIT_WIDTHS = (2, 4, 8, 32)
AGGREGATORS = ("naive", "prowd_lite", "grouped", "fp32_only")


def bit_widths(n_clients: int, widths=BIT_WIDTHS) -> np.ndarray:
    """Client k's bit-width: `widths` in contiguous, equal-as-possible groups of ids (the Dirichlet split is
    random, so the id order carries no data)."""
    widths = tuple(check_bits(b) for b in widths)
    if n_clients < len(widths):
        raise ValueError(f"n_clients ({n_clients}) must be >= the number of bit-widths ({len(widths)})")
    return np.array([widths[k * len(widths) // n_clients] for k in range(n_clients)])


def upload_generator(seed: int, rnd: int, client: int) -> torch.Generator:
    """The keyed generator of one client's stochastic rounding in one round."""
    return torch.Generator().manual_seed(int(rng(seed, PROWD, rnd, client).integers(2 ** 62)))


@dataclass
class QATClient(OwnTraining):
    """Client k at bit-width bits[k]: start from Q_b(θ), local SGD on the loss at fake_quantize(w) (STE), upload
    Q_b(w) as Δ = Q_b(w) − θ plus its bit-width. b = 32 is FedAvg's client step for step."""
    bits: tuple = ()
    spec: tuple = ()
    stochastic: bool = False

    def local_train(self, method, ctx, jobs, down, cstate):
        if not ctx.optimizer.plain:
            raise ValueError("QATClient runs plain client SGD; build the method with prowd(...)")
        if len(self.bits) != ctx.fed.num_clients:
            raise ValueError(f"bits has {len(self.bits)} entries but the federation has {ctx.fed.num_clients} "
                             "clients; pass bits=bit_widths(fed.num_clients)")
        theta, lr = down["theta"], ctx.lr
        out, losses, widths = [], [], []
        for job in jobs:
            b = int(self.bits[job.client_id])
            loss_at = grad_and_value(lambda w, x, y: ctx.loss_fn(fake_quantize_flat(w, self.spec, b), x, y))
            w, total = quantize_flat(theta, self.spec, b), theta.new_zeros(())  # the device stores Q_b(θ)
            for idx in job.batches:
                idx = torch.as_tensor(idx, device=theta.device)
                grad, loss = loss_at(w, job.x[idx], job.y[idx])
                w = w - lr * grad
                total += loss.detach()
            g = upload_generator(ctx.seed, ctx.round, job.client_id) if self.stochastic else None
            out.append(quantize_flat(w, self.spec, b, self.stochastic, g) - theta)
            losses.append(total / max(len(job.batches), 1))
            widths.append(b)
        return ({"delta": torch.stack(out), "bits": torch.tensor(widths, device=theta.device)}, cstate,
                torch.stack(losses))


@dataclass
class QuantisedBytes(Transform):
    """Wire size: a b-bit client's weights at b bits plus one float32 R per weight tensor, its biases as float32, and
    its bit-width byte."""
    spec: tuple = ()

    def __call__(self, msgs, cstate, ctx):
        msgs.bytes = torch.tensor([model_bytes(self.spec, int(b)) + 1 for b in msgs["bits"]], dtype=torch.int64)
        return msgs, cstate


# --- ProWD-lite: per-layer bin-centroid dequantisers fitted on the 32-bit clients' weights -----------------
def fit_dequantiser(reference: torch.Tensor, spec, bits: int) -> torch.Tensor:
    """[L, 2^b − 1] table: per weight tensor, the mean of w/R over the entries of the reference models [n, d]
    whose b-bit code (R = that model's layer max|w|) is ℓ; codes with no entry keep their grid value (ℓ − m)/m.
    Bias tensors (full precision on every device) keep the grid row and are never dequantised."""
    bits = check_bits(bits)
    if bits == FULL_PRECISION:
        raise ValueError("a 32-bit upload needs no dequantiser; fit one for bits in 2 … 16")
    if reference.dim() != 2 or len(reference) == 0:
        raise ValueError(f"reference must be [n >= 1, d] full-precision models, got shape {tuple(reference.shape)}")
    n_lev = levels(bits)
    grid = dequantize(torch.arange(n_lev), bits, torch.tensor(1.0, dtype=reference.dtype))
    tables = []
    for (name, _), s in zip(spec, layer_slices(spec)):
        if is_bias(name):
            tables.append(grid)
            continue
        sums, counts = torch.zeros(n_lev, dtype=reference.dtype), torch.zeros(n_lev, dtype=reference.dtype)
        for w in reference[:, s]:
            ell, R = quantize_levels(w, bits)
            if R > 0:
                sums.index_add_(0, ell.long().cpu(), (w / R).cpu())
                counts.index_add_(0, ell.long().cpu(), torch.ones_like(w).cpu())
        tables.append(torch.where(counts > 0, sums / counts.clamp_min(1), grid))
    return torch.stack(tables)


def apply_dequantiser(upload: torch.Tensor, spec, bits: int, table: torch.Tensor) -> torch.Tensor:
    """A b-bit upload (grid values, R = its layer max) with every level of a weight tensor replaced by
    R · table[layer, ℓ]; bias tensors (sent at full precision) pass unchanged."""
    parts = []
    for i, ((name, _), s) in enumerate(zip(spec, layer_slices(spec))):
        if is_bias(name):
            parts.append(upload[s])
            continue
        ell, R = quantize_levels(upload[s], bits)  # on the grid already: recovers the levels exactly
        parts.append(R * table[i].to(upload)[ell.long()])
    return torch.cat(parts)


@dataclass
class DequantisedMean:
    """Size-weighted mean of the uploads after each low-bit upload is passed through the dequantiser fitted, this
    round, on the round's 32-bit uploads (none this round: grid values, i.e. the naive mean)."""
    spec: tuple = ()
    uses_context = True

    def init_state(self, theta, num_clients):
        return {}

    def aggregate(self, state, deltas, weights, info):
        bits, theta = info.messages["bits"], info.theta
        models = theta + deltas
        reference = models[bits == FULL_PRECISION]
        if len(reference):
            for b in bits.unique().tolist():
                if b == FULL_PRECISION:
                    continue
                table = fit_dequantiser(reference, self.spec, int(b))
                for i in (bits == b).nonzero().ravel().tolist():
                    models[i] = apply_dequantiser(models[i], self.spec, int(b), table)
        return weighted_mean(models - theta, weights), state


def group_sampler(bits, width: int):
    """A sampler that takes every client of bit-width `width`, every round (grouped averaging, 32-bit-only)."""
    ids = np.flatnonzero(np.asarray(bits) == check_bits(width))
    if len(ids) == 0:
        raise ValueError(f"no client has bit-width {width}; bit-widths present: {sorted(set(np.asarray(bits).tolist()))}")
    return lambda round, num_clients, g: ids


@torch.no_grad()
def deployed_accuracy(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                      widths=BIT_WIDTHS) -> dict:
    """Test accuracy of the model a b-bit device runs, Q_b(θ) (per-layer R = max|w|), for each b."""
    spec = tuple(param_spec(model))
    return {int(b): evaluate(model, quantize_flat(theta, spec, int(b)), x, y)[1] for b in widths}


@register("prowd", claims="prowd", kind="method")
def prowd(model: torch.nn.Module, bits, aggregator: str = "prowd_lite", stochastic: bool = False,
          server_lr: float = 1.0) -> Method:
    """Bit-width heterogeneous FedAvg: `bits[k]` is client k's bit-width (`bit_widths(K)`); `aggregator` "naive"
    (FedAvg on the grid values) or "prowd_lite" (our simplification, see the module docstring). For "grouped" and
    "fp32_only" build `prowd(model, bits, "naive")` and pass `clients_per_round=group_sampler(bits, b)`.
    `stochastic`: unbiased stochastic rounding of the uploads (default nearest)."""
    if aggregator not in ("naive", "prowd_lite"):
        raise ValueError(f"aggregator must be 'naive' or 'prowd_lite', got {aggregator!r}; grouped / fp32_only are "
                         "the naive rule with clients_per_round=group_sampler(bits, b)")
    bits = tuple(check_bits(int(b)) for b in bits)
    spec = tuple((n, tuple(s)) for n, s in param_spec(model))
    rule = weighted_mean if aggregator == "naive" else DequantisedMean(spec)
    return Method(f"prowd_{aggregator}", client=QATClient(bits, spec, bool(stochastic)), weighting=DataSizeWeighting(),
                  rule=rule, server_opt=ServerSGD(lr=server_lr), uplink=(QuantisedBytes(spec),))
