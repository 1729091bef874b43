"""Self-FL — Chen, Ding, Tramel, Wu, Sahu, Avestimehr, Zhang, "Self-Aware Personalized Federated Learning",
NeurIPS 2022, arXiv:2204.08069. No official code was found.

**The exact part: a two-level Gaussian model.** Client means θ_k ~ N(θ, σ₀²) around a global θ (inter-client
variance σ₀²); client k's local estimate x̂_k ~ N(θ_k, σ_k²) (intra-client variance, σ_k² = σ²/n_k for a mean
of n_k observations). Then

    posterior mean   E[θ_k | x̂_k, θ] = b_k x̂_k + (1 − b_k) θ,      b_k = σ₀² / (σ₀² + σ_k²)
    global (GLS/ML)  θ̂ = Σ_k x̂_k / (σ₀² + σ_k²)  /  Σ_k 1 / (σ₀² + σ_k²)

a precision-weighted shrinkage of the local estimate towards the global one (b_k grows with σ₀²: more
inter-client variation, more personalisation) and a precision-weighted — not sample-size-weighted — average.
`closed_form_mse` gives every estimator's exact MSE (classical empirical Bayes; the paper's starting point).

**The learned version (a reading of the paper's deep-learning algorithm; details marked in the notebook).**
Each sampled client trains from the broadcast θ for the run's local schedule (T plain SGD steps), keeping the
iterates w_0 … w_T; its local estimate is x̂_k = w_T and its intra-client uncertainty σ_k² the mean
per-parameter variance of the iterates (SGD's trajectory as an approximate posterior). Its personal model is
the *early-stopped* iterate w_ℓ with ℓ_k = round(b_k T) ∈ [1, T] — the uncertainty-driven number of local
steps that realises the shrinkage b_k along the path from θ to x̂_k. It sends x̂_k − θ and σ_k²; the server
estimates σ₀² by the method of moments (across-client variance of the x̂_k minus the mean σ_k²) and
aggregates with weights 1/(σ₀² + σ_k²). Before the first estimate (σ₀² = ∞) b_k = 1 and the weights are equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad_and_value

from ...core.method import Method, OwnTraining, ServerSGD, UniformWeighting
from ...core.registry import register
from ...core.streams import register_stream
from ...utils import rng

MONTE_CARLO = register_stream("self_fl_monte_carlo", 42)   # the Monte-Carlo draws of the Gaussian model


# --- the exact part: the hierarchical Gaussian model -------------------------------------------------
def shrinkage(sigma_sq: torch.Tensor, sigma0_sq) -> torch.Tensor:
    """b_k = σ₀² / (σ₀² + σ_k²), the weight of the local estimate in the posterior mean (1 when σ₀² = ∞)."""
    sigma0_sq = torch.as_tensor(sigma0_sq, dtype=sigma_sq.dtype)
    b = (sigma0_sq / (sigma0_sq + sigma_sq)).nan_to_num(1.0)  # 0/0 (no variance at all): keep the local estimate
    return torch.where(torch.isinf(sigma0_sq), torch.ones_like(sigma_sq), b)


def posterior_mean(local: torch.Tensor, sigma_sq: torch.Tensor, global_mean: torch.Tensor, sigma0_sq) -> torch.Tensor:
    """E[θ_k | x̂_k, θ] = b_k x̂_k + (1 − b_k) θ for the rows x̂_k of `local` ([K] or [K, d])."""
    b = shrinkage(sigma_sq, sigma0_sq).reshape(-1, *([1] * (local.dim() - 1)))
    return b * local + (1 - b) * global_mean


def precision_weights(sigma_sq: torch.Tensor, sigma0_sq) -> torch.Tensor:
    """Normalised GLS weights ∝ 1/(σ₀² + σ_k²) (equal weights while σ₀² = ∞)."""
    sigma0_sq = torch.as_tensor(sigma0_sq, dtype=sigma_sq.dtype)
    if torch.isinf(sigma0_sq):
        return torch.full_like(sigma_sq, 1.0 / len(sigma_sq))
    w = 1.0 / (sigma0_sq + sigma_sq).clamp_min(torch.finfo(sigma_sq.dtype).tiny)
    return w / w.sum()


def moment_sigma0_sq(local: torch.Tensor, sigma_sq: torch.Tensor) -> torch.Tensor:
    """Method-of-moments σ̂₀²: E[unweighted sample variance of the x̂_k] = σ₀² + mean σ_k², per coordinate
    averaged over coordinates, clipped at 0 (with fewer than 2 clients: +∞, nothing to estimate from)."""
    if len(local) < 2:
        return torch.tensor(float("inf"), dtype=local.dtype)
    spread = local.reshape(len(local), -1).var(0, unbiased=True).mean()
    return (spread - sigma_sq.mean()).clamp_min(0.0)


def closed_form_mse(sigma0_sq: float, sigma_sq: torch.Tensor, weights: torch.Tensor | None = None) -> dict:
    """Exact per-client MSE (per coordinate) of each estimator of θ_k, θ unknown and estimated by
    θ̂ = Σ_j w_j x̂_j (`weights` normalised; None: the precision weights), σ₀² known:
    local x̂_k: σ_k²;  global θ̂: Σ_j w_j²(σ₀² + σ_j²) − 2 w_k σ₀² + σ₀²;  personal b x̂_k + (1 − b) θ̂:
    b² σ_k² + (1 − b)² MSE_global + 2 b (1 − b) w_k σ_k²;  oracle posterior (θ known): σ₀²σ_k²/(σ₀² + σ_k²);
    and `theta` = Var(θ̂ − θ) = Σ_j w_j²(σ₀² + σ_j²), the MSE of the global mean itself."""
    if not sigma0_sq >= 0 or bool((sigma_sq < 0).any()):
        raise ValueError(f"closed_form_mse needs sigma0_sq (τ²) >= 0 and every sigma_sq (σ_k²) >= 0, got "
                         f"{sigma0_sq} and min {float(sigma_sq.min())}; pass variances, not standard deviations")
    s = sigma_sq.to(torch.float64)
    w = precision_weights(s, sigma0_sq) if weights is None else weights.to(torch.float64) / weights.sum()
    var_theta = (w ** 2 * (sigma0_sq + s)).sum()
    global_ = var_theta - 2 * w * sigma0_sq + sigma0_sq
    b = shrinkage(s, sigma0_sq)
    personal = b ** 2 * s + (1 - b) ** 2 * global_ + 2 * b * (1 - b) * w * s
    return {"local": s, "global": global_, "personal": personal, "oracle": sigma0_sq * s / (sigma0_sq + s),
            "theta": var_theta}


def sample_hierarchy(theta: float, sigma0_sq: float, sigma_sq: torch.Tensor, runs: int, dim: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo draws (float64): client means θ_k [runs, K, dim] and local estimates x̂_k [runs, K, dim]."""
    K = len(sigma_sq)
    means = theta + sigma0_sq ** 0.5 * torch.randn(runs, K, dim, generator=generator, dtype=torch.float64)
    noise = sigma_sq.to(torch.float64).sqrt()[None, :, None]
    return means, means + noise * torch.randn(runs, K, dim, generator=generator, dtype=torch.float64)


def monte_carlo_generator(seed: int) -> torch.Generator:
    """A torch generator keyed by (seed, MONTE_CARLO): the notebook's Gaussian draws move with -p seed."""
    return torch.Generator().manual_seed(int(rng(seed, MONTE_CARLO).integers(2**62)))


def empirical_bayes(local: torch.Tensor, sigma_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One federation [K, d] with τ² and θ unknown: (personal estimates [K, d], θ̂ [d], σ̂₀²) — σ̂₀² by the
    method of moments, θ̂ with the precision weights it implies, then the posterior-mean shrinkage."""
    sigma0_sq = moment_sigma0_sq(local, sigma_sq)
    theta_hat = precision_weights(sigma_sq, sigma0_sq) @ local
    return posterior_mean(local, sigma_sq, theta_hat, sigma0_sq), theta_hat, sigma0_sq


# --- the learned version -------------------------------------------------------------------------------
def trajectory(loss_fn, w0: torch.Tensor, x, y, batches, lr: float):
    """Plain local SGD from w0: (iterates [T + 1, d], mean loss)."""
    step = grad_and_value(loss_fn)
    path, losses = [w0], []
    for idx in batches:
        g, value = step(path[-1], x[idx], y[idx])
        path.append(path[-1] - lr * g)
        losses.append(value.detach())
    return torch.stack(path), (torch.stack(losses).mean() if losses else w0.new_zeros(()))


def early_stop(path: torch.Tensor, sigma0_sq) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(x̂ = w_T, σ² = mean per-parameter variance of the iterates, personal w_ℓ with ℓ = round(b T) in [1, T])."""
    T = len(path) - 1
    sigma_sq = path.var(0, unbiased=True).mean() if T >= 1 else path.new_zeros(())
    if T == 0:
        return path[0], sigma_sq, 0
    b = shrinkage(sigma_sq.reshape(1), sigma0_sq)[0]
    steps = int(min(max(round(float(b) * T), 1), T))
    return path[-1], sigma_sq, steps


@dataclass
class SelfFLClient(OwnTraining):
    """Client state: "personal" (the early-stopped model of the client's latest round; θ₀ before), and its
    "steps" ℓ_k and "sigma_sq" σ_k² of that round (for inspection)."""

    def client_state(self, method, theta, groups):
        return {"personal": theta.clone(), "steps": theta.new_zeros(()), "sigma_sq": theta.new_zeros(())}

    def local_train(self, method, ctx, jobs, down, cstate):
        theta, sigma0_sq = down["theta"], down["sigma0_sq"]
        X, S, P, L, losses = [], [], [], [], []
        for j in jobs:
            path, loss = trajectory(ctx.loss_fn, theta, j.x, j.y, j.batches, ctx.lr)
            local, sigma_sq, steps = early_stop(path, sigma0_sq)
            X.append(local), S.append(sigma_sq), P.append(path[steps]), L.append(float(steps)), losses.append(loss)
        S = torch.stack(S)
        new = {"personal": torch.stack(P), "steps": theta.new_tensor(L), "sigma_sq": S}
        return {"delta": torch.stack(X) - theta, "sigma_sq": S}, new, torch.stack(losses)

    def personal(self, method, theta, cstate, groups):
        return cstate["personal"]


@dataclass
class UncertaintyWeightedMean:
    """Server rule: σ̂₀² by the method of moments from the round's x̂_k − θ and σ_k², then Σ_k w_k Δ_k with
    w_k ∝ 1/(σ̂₀² + σ_k²). σ̂₀² is broadcast (the clients' b_k) and reported as the column `sigma0_sq`."""
    uses_context = True

    def init_state(self, theta, num_clients):
        return {"sigma0_sq": torch.tensor(float("inf"), dtype=theta.dtype)}

    def broadcast(self, state):
        return {"sigma0_sq": state["sigma0_sq"]}

    def aggregate(self, state, deltas, weights, info):
        if info.messages is None or "sigma_sq" not in info.messages.tensors:
            raise ValueError("Self-FL's rule needs each client's sigma_sq in its message; build the method with "
                             "fedlab_nb.methods.personalisation.self_fl.self_fl()")
        sigma_sq = info.messages["sigma_sq"].to(deltas.dtype)
        estimate = moment_sigma0_sq(deltas, sigma_sq)
        sigma0_sq = state["sigma0_sq"] if torch.isinf(estimate) else estimate.cpu()
        return precision_weights(sigma_sq, sigma0_sq.to(deltas.dtype)) @ deltas, {"sigma0_sq": sigma0_sq}

    def metrics(self, state):
        return {"sigma0_sq": float(state["sigma0_sq"])}


@register("self_fl", claims="self_fl")
def self_fl(server_lr: float = 1.0) -> Method:
    """Self-FL's learned version (no knobs: the local schedule and lr are the run's)."""
    if not server_lr > 0:
        raise ValueError(f"Self-FL's server_lr must be > 0, got {server_lr}")
    return Method("self_fl", weighting=UniformWeighting(), rule=UncertaintyWeightedMean(),
                  server_opt=ServerSGD(lr=server_lr), client=SelfFLClient())
