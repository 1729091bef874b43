"""FedSVD — SVD reparameterisation of LoRA under DP-SGD (Lee, Park, Lee, Wagner, Seong, Bocklet, Lee, Hwang,
"FedSVD: Adaptive Orthogonalization for Private Federated Learning with LoRA", NeurIPS 2025,
https://arxiv.org/abs/2505.12805; code: https://github.com/seanie12/fed-svd), with its two baselines.

Every client fine-tunes a LoRA model W₀ + (α/r)·B A with DP-SGD (Abadi et al. 2016): Poisson-sampled
mini-batches (rate q), per-sample gradients (`torch.func.vmap(grad(...))`), each clipped to norm C, the
sum plus N(0, (z C)² I), divided by the expected batch q·n_k, then an SGD step. The three methods differ in
what is trained, sent and done at the server:

    FedSVD       train B only, send B;  server: B̄ = Σ p_k B_k,  B̄ A = U Σ Vᵀ,  A ← V_rᵀ,  B ← U_r Σ_r
    FFA-LoRA     train B only, send B;  server: B ← B̄, A stays the frozen random init
                 (Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024)
    DP-LoRA      train A and B, send both; server: A ← Ā, B ← B̄ (FedAvg of the factors)

The refactorisation changes no function: B_new A_new = B̄ A (the product has rank ≤ r, so its rank-r SVD is
exact), and A_new has orthonormal rows, so a per-sample ∇_B = (α/r) ∇_W Aᵀ has ‖∇_B‖_F ≤ (α/r)‖∇_W‖_F
(the paper's gradient bound): clipping at C then cuts less of the signal.

Details taken from the official code (seanie12/fed-svd, scripts/run_dp.sh): A starts Kaiming-uniform, B = 0
(peft's default); the SVD runs after every round's aggregation (`--recalculate-svd-period 1`) and both factors
are broadcast; B is *kept* as U_r Σ_r (not reset); clients use plain SGD (no momentum) with a fresh optimiser
every round, so no optimiser state meets the rotated factors; p_k ∝ n_k; flat per-sample clipping over all
trained tensors (opacus); q = B/n_k per client, noise calibrated for n_iter × rounds × frac steps at δ = 1e-5
(PRV accountant); r = α = 8, lr 0.5, C = 2, 10 local steps. Here: one sampling rate q for all clients (so one
calibration gives every client the same (ε, δ)); the RDP accountant of `fedlab_nb.methods.privacy.accounting`; the
composition runs over rounds × local_steps — exact when every client takes part in every round (the
default, clients_per_round=None), an upper bound otherwise (no amplification by client sampling is used).
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad_and_value, vmap

from ...core.history import History
from ...core.method import Method, OwnTraining, ServerAssign, weighted_mean
from ...core.registry import register
from ...core.streams import register_stream
from ...engine import simulate
from ...lora import LoRALayout, add_lora
from ...utils import check_number, check_positive_int, rng
from . import accounting
from .dp import check_noise

DP_SGD = register_stream("dp_sgd", 26)   # each client's Poisson batches and Gaussian noise in DP-SGD
VARIANTS = ("fedsvd", "ffa", "dp_lora")


# ----------------------------------------------------------------------------------------------------
# The server's refactorisation and the DP-SGD pieces (pure functions)


def refactorize(B: Tensor, A: Tensor) -> tuple[Tensor, Tensor]:
    """FedSVD's server step for one layer: B A = U Σ Vᵀ (rank ≤ r) → (B_new = U_r Σ_r, A_new = V_rᵀ), so
    B_new A_new = B A and A_new has orthonormal rows. B is [d, r], A is [r, k] with r ≤ min(d, k)."""
    if B.dim() != 2 or A.dim() != 2 or B.shape[1] != A.shape[0]:
        raise ValueError(f"B must be [d, r] and A [r, k] with the same r, got B {tuple(B.shape)} and A {tuple(A.shape)}")
    (d, r), k = B.shape, A.shape[1]
    if r > min(d, k):
        raise ValueError(f"rank r = {r} exceeds min(d, k) = {min(d, k)}: the SVD of B A ({d}×{k}) has only "
                         f"{min(d, k)} components; use a rank ≤ {min(d, k)}")
    U, S, Vh = torch.linalg.svd(B @ A, full_matrices=False)
    return U[:, :r] * S[:r], Vh[:r]


def clip_per_sample(grads: dict, clip_norm: float) -> tuple[dict, Tensor]:
    """Flat per-sample clipping (opacus): the rows [n, ...] of every tensor in `grads` are scaled together by
    min(1, C / (‖g_i‖ + 1e-6)), ‖g_i‖ the norm over all tensors. Returns (clipped grads, norms [n])."""
    if not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 (the per-sample L2 bound C), got {clip_norm!r}")
    norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()))
    factor = (clip_norm / (norms + 1e-6)).clamp(max=1.0)
    return {n: g * factor.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}, norms


def per_sample_grads(model, trainable: dict, frozen: dict, x: Tensor, y: Tensor) -> tuple[dict, Tensor]:
    """∇ of each sample's cross-entropy w.r.t. `trainable` ({name: tensor}), and the losses [n], by
    `vmap(grad(...))` over the rows of x [n, D] (the other tensors of `model` are its own buffers)."""
    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, {**frozen, **p}, (xi[None],)), yi[None])
    return vmap(grad_and_value(one), in_dims=(None, 0, 0))(trainable, x, y)


def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, rounds: int, local_steps: int,
                         accountant: str = "rdp") -> float:
    """z giving each client (ε, δ)-DP at the sample level after `rounds` × `local_steps` DP-SGD steps of
    Poisson rate q (`fedlab_nb.methods.privacy.accounting.noise_for_epsilon`, dp-accounting's calibration)."""
    steps = _steps(rounds, local_steps, 1)
    return _calibrated(check_number("epsilon", epsilon, 0), check_number("delta", delta, 0, 1),
                       check_number("sample_rate", sample_rate, 0), steps, accountant)


@functools.lru_cache(maxsize=256)  # a pure function of checked numbers; the calibration takes about a second
def _calibrated(epsilon: float, delta: float, sample_rate: float, steps: int, accountant) -> float:
    return accounting.noise_for_epsilon(epsilon, sample_rate, steps, delta, accountant=accountant)


def spent_epsilon(noise_multiplier: float, delta: float, sample_rate: float, rounds: int, local_steps: int,
                  accountant: str = "rdp") -> float:
    """ε each client has spent after `rounds` × `local_steps` steps (inf without noise)."""
    return accounting.epsilon(sample_rate, noise_multiplier, _steps(rounds, local_steps, 0), delta, accountant=accountant)


def _steps(rounds, local_steps, min_rounds: int) -> int:
    """rounds × local_steps, each a whole count (a negative pair would multiply to a positive number of steps)."""
    return check_positive_int("rounds", rounds, min_rounds) * check_positive_int("local_steps", local_steps)


# ----------------------------------------------------------------------------------------------------
# Clients: DP-SGD on the LoRA factors, all the round's clients at once


def _poisson_batches(sizes, q: float, gens) -> tuple[Tensor, Tensor]:
    """One Poisson draw per client (each of its n_k rows kept with probability q), padded: row ids [m, L] and
    a 0/1 weight [m, L] (L ≥ 1: an empty batch still takes a noise-only step, as in opacus)."""
    picks = [torch.nonzero(torch.rand(int(n), generator=g) < q).flatten() for n, g in zip(sizes, gens)]
    L = max(1, max(len(p) for p in picks))
    idx, w = torch.zeros(len(picks), L, dtype=torch.long), torch.zeros(len(picks), L)
    for i, p in enumerate(picks):
        idx[i, :len(p)], w[i, :len(p)] = p, 1.0
    return idx, w


def dp_sgd_clients(model, layout: LoRALayout, theta: Tensor, data, *, train_a: bool, steps: int, sample_rate: float,
                   lr: float, clip_norm: float | None, noise_multiplier: float, generators) -> tuple[Tensor, Tensor]:
    """DP-SGD from the broadcast LoRA factors θ for m clients (`data[i] = (x, y)`), vmapped over clients and
    over each batch's samples. Trains B (and A when `train_a`); `clip_norm=None` with z = 0 is non-private SGD
    on the same Poisson batches. Returns the clients' final θ rows [m, size] and mean batch losses [m]."""
    m, dev = len(data), theta.device
    sizes = [len(y) for _, y in data]
    x_pad = torch.zeros(m, max(sizes), data[0][0].shape[1], device=dev)
    y_pad = torch.zeros(m, max(sizes), dtype=torch.long, device=dev)
    for i, (x, y) in enumerate(data):
        x_pad[i, :len(y)], y_pad[i, :len(y)] = x, y
    params = layout.params(theta)
    names = [n for n in params if train_a or n.endswith("lora_B")]
    frozen = {n: t for n, t in params.items() if n not in names}   # A of FedSVD / FFA-LoRA: shared by all clients
    train = {n: params[n].expand(m, *params[n].shape).clone() for n in names}
    grads_fn = vmap(lambda p, x, y: per_sample_grads(model, p, frozen, x, y), in_dims=(0, 0, 0))
    expected = torch.tensor([sample_rate * n for n in sizes], device=dev)  # opacus divides by q·n_k
    rows = torch.arange(m, device=dev)[:, None]
    total = torch.zeros(m, device=dev)
    for _ in range(steps):
        idx, w = (t.to(dev) for t in _poisson_batches(sizes, sample_rate, generators))
        g, losses = grads_fn(train, x_pad[rows, idx], y_pad[rows, idx])           # [m, L, ...], [m, L]
        total += (losses * w).sum(1) / w.sum(1).clamp_min(1)
        if clip_norm is not None:
            flat = {n: t.reshape(-1, *t.shape[2:]) for n, t in g.items()}
            clipped, _ = clip_per_sample(flat, clip_norm)
            g = {n: t.reshape(g[n].shape) for n, t in clipped.items()}
        for n in names:
            s = (g[n] * w.view(m, -1, *([1] * (g[n].dim() - 2)))).sum(1)
            if noise_multiplier:
                noise = torch.stack([torch.randn(s.shape[1:], generator=gen) for gen in generators]).to(dev)
                s = s + noise_multiplier * clip_norm * noise
            train[n] = train[n] - lr * s / expected.view(m, *([1] * (s.dim() - 1)))
    rows_theta = layout.join([(train.get(f"{n}.lora_A", params[f"{n}.lora_A"].expand(m, -1, -1)),
                               train[f"{n}.lora_B"]) for n in layout.names])
    return rows_theta.detach(), total / steps


@dataclass
class DPLoRAClientUpdate(OwnTraining):
    """A round of DP-SGD on the broadcast LoRA factors (`local_train`): `local_steps` Poisson batches of rate
    `sample_rate`, per-sample clipping at `clip_norm`, noise z = `noise_multiplier`, step size the run's lr.
    Sends "B" (its B factors, FedSVD and FFA-LoRA) or "lora" (A and B, DP-LoRA). The run's batch_size and
    local_epochs are not used: DP-SGD draws its own batches from stream `DP_SGD`, keyed by (seed, round, client)."""
    layout: LoRALayout
    train_a: bool = False
    local_steps: int = 10
    sample_rate: float = 0.05
    clip_norm: float | None = 2.0
    noise_multiplier: float = 0.0

    def local_train(self, method, ctx, jobs, down, cstate):
        seed = ctx.seed
        gens = [torch.Generator().manual_seed(int(rng(seed, DP_SGD, ctx.round, j.client_id).integers(2**62))) for j in jobs]
        W, losses = dp_sgd_clients(ctx.model, self.layout, down["theta"], [(j.x, j.y) for j in jobs],
                                   train_a=self.train_a, steps=self.local_steps, sample_rate=self.sample_rate,
                                   lr=ctx.lr, clip_norm=self.clip_norm, noise_multiplier=self.noise_multiplier,
                                   generators=gens)
        return ({"lora": W} if self.train_a else {"B": self.layout.b_only(W)}), cstate, losses


# ----------------------------------------------------------------------------------------------------
# The server: aggregate the sent factors, refactorise (FedSVD)


@dataclass
class LoRAServerRule:
    """The rule returns the new θ (with `ServerAssign`): FedSVD — B̄ then `refactorize` of every layer every
    `refactor_every` rounds; FFA-LoRA — the broadcast A with B̄; DP-LoRA — the weighted mean of the (A, B)
    rows. Weights are the engine's (p_k ∝ n_k, as in the official code)."""
    layout: LoRALayout
    variant: str = "fedsvd"
    refactor_every: int = 1
    uses_context = True

    def __call__(self, rows: Tensor, weights: Tensor | None = None, info=None) -> Tensor:
        mean = weighted_mean(rows, weights)
        if self.variant == "dp_lora":
            return mean
        factors = [(a, b) for (a, _), b in zip(self.layout.split(info.theta), self.layout.split_b(mean))]
        if self.variant == "fedsvd" and (info.round + 1) % self.refactor_every == 0:
            factors = [(a_new, b_new) for b_new, a_new in (refactorize(b, a) for a, b in factors)]
        return self.layout.join(factors)


def lora_dp_method(model, variant: str = "fedsvd", *, local_steps: int = 10, sample_rate: float = 0.05,
                   clip_norm: float | None = 2.0, noise_multiplier: float = 0.0, refactor_every: int = 1) -> Method:
    """FedSVD, FFA-LoRA or DP-LoRA (`variant`) as a pipeline `Method` for a LoRA `model` (`add_lora`).
    `noise_multiplier=0, clip_norm=None`: the non-private version on the same batches."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_positive_int("local_steps", local_steps)
    check_positive_int("refactor_every", refactor_every)
    if not (isinstance(sample_rate, numbers.Real) and not isinstance(sample_rate, bool) and 0 < sample_rate <= 1):
        raise ValueError(f"sample_rate is the Poisson rate q of DP-SGD, a number in (0, 1]; got {sample_rate!r}")
    noise_multiplier = check_noise(noise_multiplier)
    if clip_norm is not None:  # inf clips nothing: the noise z·C would be inf
        clip_norm = check_number("clip_norm", clip_norm, 0, fix="the per-sample L2 bound C, e.g. 2.0 (None: no clipping)")
    if noise_multiplier and clip_norm is None:
        raise ValueError("noise without clipping bounds nothing: pass clip_norm (e.g. 2.0) with noise_multiplier > 0")
    layout = LoRALayout.of(model)
    client = DPLoRAClientUpdate(layout, variant == "dp_lora", local_steps, sample_rate, clip_norm, noise_multiplier)
    rule = LoRAServerRule(layout, variant, refactor_every)
    return Method(variant, rule=rule, server_opt=ServerAssign(), client=client,
                  aggregate_key="lora" if variant == "dp_lora" else "B")


# ----------------------------------------------------------------------------------------------------
# Runs


def _run(variant: str, fed, base_model, *, rank: int = 4, alpha: float | None = None, targets=None,
         epsilon: float | None = None, delta: float = 1e-5, rounds: int = 20, local_steps: int = 10,
         sample_rate: float = 0.05, clip_norm: float = 2.0, lr: float = 0.5, refactor_every: int = 1,
         seed: int = 0, eval_every: int | None = None) -> History:
    check_positive_int("rounds", rounds)
    if epsilon is not None and not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, or None for the non-private run; got {epsilon!r}")
    model = add_lora(base_model, rank, alpha, targets, seed=seed)
    z = 0.0 if epsilon is None else noise_multiplier_for(epsilon, delta, sample_rate, rounds, local_steps)
    method = lora_dp_method(model, variant, local_steps=local_steps, sample_rate=sample_rate,
                            clip_norm=clip_norm, noise_multiplier=z,
                            refactor_every=refactor_every)
    hist = simulate(method, fed, model, rounds=rounds, clients_per_round=None, lr=lr, seed=seed,
                    eval_every=eval_every or rounds, backend="loop", progress=False)
    hist.meta.update({"variant": variant, "rank": rank, "epsilon_target": epsilon, "delta": delta,
                      "noise_multiplier": z, "sample_rate": sample_rate, "local_steps": local_steps,
                      "clip_norm": clip_norm})
    return hist


@register("fedsvd", claims="fedsvd", kind="module")
def run_fedsvd(fed, base_model, **kwargs) -> History:
    """FedSVD on a `FederatedDataset`: LoRA (`add_lora(base_model, rank, alpha, targets)`) fine-tuned by every
    client each round with DP-SGD at (`epsilon`, `delta`) per client (None: non-private), B sent, SVD
    refactorisation at the server. Keywords: rank, alpha, targets, epsilon, delta, rounds, local_steps,
    sample_rate, clip_norm, lr, refactor_every, seed, eval_every. `hist.model` is the LoRA model, `hist.theta`
    its final factors, `hist.meta["noise_multiplier"]` the calibrated z."""
    return _run("fedsvd", fed, base_model, **kwargs)


@register("ffa_lora", claims="fedsvd", kind="module")
def run_ffa_lora(fed, base_model, **kwargs) -> History:
    """FFA-LoRA (A frozen at its random init, B trained and sent) with the same keywords as `run_fedsvd`."""
    return _run("ffa", fed, base_model, **kwargs)


@register("dp_lora", claims="fedsvd", kind="module")
def run_dp_lora(fed, base_model, **kwargs) -> History:
    """Vanilla DP-LoRA (A and B trained with DP-SGD and averaged) with the same keywords as `run_fedsvd`."""
    return _run("dp_lora", fed, base_model, **kwargs)


def lora_gradient_norms(model, theta: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample gradient norms of every LoRA layer at θ: (‖∇_B‖_F, (α/r)·‖∇_W‖_F), each [n, layers], where
    ∇_W is the gradient w.r.t. the layer's dense weight W = W₀ + (α/r) B A (so ∇_B = (α/r) ∇_W Aᵀ and the
    first is ≤ the second when A has orthonormal rows: FedSVD's bound)."""
    layout = LoRALayout.of(model)
    params = layout.params(theta)
    frozen_a = {n: t for n, t in params.items() if n.endswith("lora_A")}
    gB, _ = per_sample_grads(model, {n: t for n, t in params.items() if n.endswith("lora_B")}, frozen_a, x, y)
    layers = dict(model.named_modules())
    dense = {}   # W as the differentiable input, with the LoRA term switched off (B = 0): same function
    for name, s, (a, b) in zip(layout.names, layout.scalings, layout.split(theta)):
        dense[f"{name}.weight"] = layers[name].weight + s * b @ a
    zeros = {f"{n}.lora_B": torch.zeros_like(params[f"{n}.lora_B"]) for n in layout.names}
    gW, _ = per_sample_grads(model, dense, {**frozen_a, **zeros}, x, y)
    norm = lambda g: g.reshape(g.shape[0], -1).norm(dim=1)
    b_norms = torch.stack([norm(gB[f"{n}.lora_B"]) for n in layout.names], 1)
    w_norms = torch.stack([s * norm(gW[f"{n}.weight"]) for n, s in zip(layout.names, layout.scalings)], 1)
    return b_norms, w_norms


def orthonormality_error(A: Tensor) -> float:
    """max |A Aᵀ − I| (0 for orthonormal rows)."""
    return float((A @ A.T - torch.eye(A.shape[0], dtype=A.dtype, device=A.device)).abs().max())


__all__ = ["refactorize", "clip_per_sample", "per_sample_grads", "dp_sgd_clients", "lora_dp_method",
           "noise_multiplier_for", "spent_epsilon", "run_fedsvd", "run_ffa_lora", "run_dp_lora",
           "orthonormality_error", "lora_gradient_norms", "LoRAServerRule", "DPLoRAClientUpdate"]
