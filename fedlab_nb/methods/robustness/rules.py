"""Robust aggregation rules as pure tensor functions.

Every rule has the shape ``rule(updates, weights=None, *, hyper...) -> Tensor[d]``:

* ``updates``  — ``Tensor[n, d]``, one flattened client update per row (x_1 … x_n in the papers);
* ``weights``  — optional non-negative ``Tensor[n]`` (e.g. data sizes n_k). Rules with a natural weighted
  form use it (mean, multi-Krum's final average, geometric median, centered clipping, GAS's final
  average); the order-statistic rules (median, trimmed mean, Krum's selection, Bulyan) and the
  direction-based rules (FLTrust, FlagAggregator) ignore it — see each docstring.

Rules keep the device and dtype of ``updates`` and never loop over coordinates. A row containing NaN/Inf
makes every rule raise ``ValueError`` naming the rows; ``get_rule(name, drop_nonfinite=True)`` instead
drops those rows first (see :func:`drop_nonfinite`).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
from typing import Callable

import torch
from torch import Tensor

# ----------------------------------------------------------------------------------------------------
# Input checks shared by every rule


def _nonfinite_rows(updates: Tensor) -> list[int]:
    """Rows with a NaN/Inf entry. A row sum is non-finite whenever an entry is (and, rarely, on overflow),
    so the cheap row sums screen the rows and only the flagged ones are checked entry by entry."""
    suspects = (~torch.isfinite(updates.sum(dim=1))).nonzero().flatten()
    if len(suspects) == 0:
        return []
    bad = (~torch.isfinite(updates[suspects])).any(dim=1)
    return suspects[bad].tolist()


def _check_updates(updates: Tensor, weights: Tensor | None) -> Tensor | None:
    """Validate ``updates [n, d]`` and ``weights [n]``; return weights cast to the updates' dtype."""
    if not isinstance(updates, Tensor):
        raise TypeError(f"updates must be a torch.Tensor of shape [n, d], got {type(updates).__name__}")
    if updates.dim() != 2 or updates.shape[0] == 0:
        raise ValueError(f"updates must have shape [n, d] with n >= 1, got {tuple(updates.shape)}; "
                         "stack flattened client updates with torch.stack(list_of_vectors)")
    if not updates.is_floating_point():
        raise TypeError(f"updates must be a floating-point tensor, got dtype {updates.dtype}")
    rows = _nonfinite_rows(updates)
    if rows:
        raise ValueError(f"updates has non-finite values (NaN/Inf) in client rows {rows}; drop them with "
                         "drop_nonfinite(updates, weights) or get_rule(name, drop_nonfinite=True)")
    if weights is None:
        return None
    weights = torch.as_tensor(weights, device=updates.device).to(updates.dtype)
    if weights.shape != (updates.shape[0],):
        raise ValueError(f"weights must have shape [n] = [{updates.shape[0]}], got {tuple(weights.shape)}")
    if not torch.isfinite(weights).all() or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError("weights must be finite, non-negative and not all zero (e.g. client data sizes)")
    return weights


def _normalised(weights: Tensor | None, n: int, like: Tensor) -> Tensor:
    """Weights p_i summing to one (uniform 1/n when ``weights`` is None)."""
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=like.dtype, device=like.device)
    return weights / weights.sum()


def _check_f(f: int, n: int, need: str, ok: bool, fix: str) -> None:
    if isinstance(f, bool) or not isinstance(f, numbers.Integral) or f < 0:
        raise ValueError(f"f (number of Byzantine clients) must be a non-negative int, got {f!r}")
    if not ok:
        raise ValueError(f"this rule needs {need}, got n={n} clients and f={f}; {fix}")


def drop_nonfinite(updates: Tensor, weights: Tensor | None = None):
    """Remove client rows containing NaN/Inf. Returns ``(updates, weights, kept_mask)``.

    Raises ``ValueError`` if no row is finite (there is nothing left to aggregate)."""
    if not isinstance(updates, Tensor) or updates.dim() != 2:
        raise ValueError("updates must be a tensor of shape [n, d]")
    kept = torch.ones(updates.shape[0], dtype=torch.bool, device=updates.device)
    kept[_nonfinite_rows(updates)] = False
    if not kept.any():
        raise ValueError("every client update contains NaN/Inf; nothing to aggregate")
    return updates[kept], (None if weights is None else torch.as_tensor(weights, device=updates.device)[kept]), kept


# ----------------------------------------------------------------------------------------------------
# Averaging and coordinate-wise order statistics


def mean(updates: Tensor, weights: Tensor | None = None) -> Tensor:
    """Weighted mean Σ_i p_i x_i with p_i = w_i / Σ_j w_j (FedAvg). Not robust: one row at 1e6 moves it."""
    weights = _check_updates(updates, weights)
    return _normalised(weights, updates.shape[0], updates) @ updates


def _median_rows(x: Tensor) -> Tensor:
    """Coordinate-wise median of ``x [n, d]``; even n averages the two middle values (like ``np.median``).

    ``torch.median`` (a selection, ~2× faster than a full sort) gives the lower middle value m_lo; the
    upper one is m_lo again if at least n/2 + 1 values are ≤ m_lo, else the smallest value above m_lo."""
    n = x.shape[0]
    low = x.median(dim=0).values
    if n % 2:
        return low
    enough = (x <= low).sum(dim=0) >= n // 2 + 1
    above = torch.where(x > low, x, torch.full_like(x, math.inf)).min(dim=0).values
    return 0.5 * (low + torch.where(enough, low, above))


def coordinate_median(updates: Tensor, weights: Tensor | None = None) -> Tensor:
    """Coordinate-wise median (Yin et al. 2018). Ignores ``weights``; even n averages the two middle values."""
    _check_updates(updates, weights)
    return _median_rows(updates)


def trimmed_mean(updates: Tensor, weights: Tensor | None = None, *, beta: float = 0.1) -> Tensor:
    """Coordinate-wise β-trimmed mean: per coordinate drop the k = ⌊βn⌋ smallest and k largest values
    and average the rest (same k as ``scipy.stats.trim_mean``). Ignores ``weights``. Needs 0 ≤ β < 0.5."""
    _check_updates(updates, weights)
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean needs 0 <= beta < 0.5 (fraction cut from EACH side), got beta={beta}")
    n = updates.shape[0]
    k = int(beta * n)
    return updates.sort(dim=0).values[k:n - k].mean(dim=0)


# ----------------------------------------------------------------------------------------------------
# Distance-based selection: Krum, multi-Krum, Bulyan


def _squared_distances(x: Tensor) -> Tensor:
    """Pairwise ‖x_i − x_j‖² summed from the differences (as Flower does), a block of rows at a time.

    Exactly symmetric with a zero diagonal, so equal distances stay equal and Krum's ties go to the lowest
    index (the Gram form ‖a‖² + ‖b‖² − 2aᵀb rounds d(a, b) and d(b, a) differently)."""
    n, d = x.shape
    step = max(1, 2 ** 24 // max(1, n * d))  # bounds the [step, n, d] temporary to ~16M numbers
    d2 = torch.cat([((x[i:i + step, None, :] - x[None, :, :]) ** 2).sum(dim=2) for i in range(0, n, step)])
    return (d2 + d2.T) / 2  # the two sums hold the same squares; averaging makes equality exact


def _krum_scores(d2: Tensor, f: int) -> Tensor:
    """Krum score s(i) = Σ of the squared distances from x_i to its n − f − 2 nearest other rows."""
    n = d2.shape[0]
    k = max(1, n - f - 2)
    if n == 1:
        return d2.new_zeros(1)
    others = d2 + torch.diag(d2.new_full((n,), math.inf))  # exclude i from its own neighbours
    return others.topk(min(k, n - 1), dim=1, largest=False).values.sum(dim=1)


def _krum_check(n: int, f: int, name: str) -> None:
    _check_f(f, n, "n > 2f + 2", n > 2 * f + 2,
             f"use at least {2 * f + 3} clients or assume fewer Byzantine ones (f <= {max(0, (n - 3) // 2)}) "
             f"for {name}")


def krum(updates: Tensor, weights: Tensor | None = None, *, f: int = 0) -> Tensor:
    """Krum (Blanchard et al. 2017): return the x_i with the lowest score s(i) (sum of squared distances
    to its n − f − 2 nearest neighbours). Requires n > 2f + 2. Ignores ``weights``; ties → lowest index."""
    _check_updates(updates, weights)
    _krum_check(updates.shape[0], f, "krum")
    return updates[_krum_scores(_squared_distances(updates), f).argmin()].clone()


def multi_krum(updates: Tensor, weights: Tensor | None = None, *, f: int = 0, m: int | None = None) -> Tensor:
    """Multi-Krum: average (weighted if ``weights``) the m rows with the lowest Krum scores; m defaults to
    n − f (the GAS repository's Krum). m = 1 is Krum. Requires n > 2f + 2 and 1 ≤ m ≤ n."""
    weights = _check_updates(updates, weights)
    n = updates.shape[0]
    _krum_check(n, f, "multi_krum")
    m = n - f if m is None else m
    if not 1 <= m <= n:
        raise ValueError(f"multi_krum needs 1 <= m <= n={n}, got m={m}")
    scores = _krum_scores(_squared_distances(updates), f)
    chosen = scores.sort(stable=True).indices[:m]
    w = None if weights is None else weights[chosen]
    if w is not None and w.sum() <= 0:
        w = None
    return _normalised(w, m, updates) @ updates[chosen]


def _iterated_krum(updates: Tensor, f: int, theta: int) -> Tensor:
    """Indices of θ rows chosen by repeated Krum on the remaining set (Bulyan's selection phase)."""
    d2 = _squared_distances(updates)
    remaining = torch.arange(updates.shape[0], device=updates.device)
    chosen = []
    for _ in range(theta):  # θ ≤ n small iterations on an n×n matrix
        sub = d2[remaining][:, remaining]
        best = int(_krum_scores(sub, f).argmin())
        chosen.append(remaining[best])
        remaining = torch.cat([remaining[:best], remaining[best + 1:]])
    return torch.stack(chosen)


def bulyan(updates: Tensor, weights: Tensor | None = None, *, f: int = 0) -> Tensor:
    """Bulyan (El Mhamdi et al. 2018). (1) choose θ = n − 2f rows by iterated Krum (each Krum on the
    remaining rows, with max(1, |R| − f − 2) neighbours); (2) per coordinate keep the β = θ − 2f of those
    values closest to their median and average them (at equal distance the smaller value is kept).
    Requires n ≥ 4f + 3. Ignores ``weights``."""
    _check_updates(updates, weights)
    n = updates.shape[0]
    _check_f(f, n, "n >= 4f + 3", n >= 4 * f + 3,
             f"use at least {4 * f + 3} clients or assume fewer Byzantine ones (f <= {max(0, (n - 3) // 4)})")
    theta, beta = n - 2 * f, n - 4 * f
    ordered = updates[_iterated_krum(updates, f, theta)].sort(dim=0).values
    median = ordered[theta // 2] if theta % 2 else 0.5 * (ordered[theta // 2 - 1] + ordered[theta // 2])
    # the β values closest to the median are β consecutive sorted values: the window [s, s + β), s = 0…2f,
    # with the smallest Σ|v − median|. Sliding s → s + 1 adds |v[s+β] − med| − |v[s] − med|; summed in
    # float64 so a far outlier does not swamp the comparison. Ties → the lowest s (smaller values kept).
    exact = torch.float32 if updates.device.type == "mps" else torch.float64
    slide = (ordered[beta:] - median).abs().to(exact) - (ordered[:theta - beta] - median).abs().to(exact)
    window_cost = torch.cat([slide.new_zeros((1, ordered.shape[1])), slide.cumsum(dim=0)])
    best = window_cost.argmin(dim=0)
    window = best[None, :] + torch.arange(beta, device=updates.device)[:, None]
    return ordered.gather(0, window).mean(dim=0)


# ----------------------------------------------------------------------------------------------------
# Geometric median (RFA) and centered clipping


def _geomed_objective(updates: Tensor, p: Tensor, z: Tensor) -> Tensor:
    return (p * (updates - z).norm(dim=1)).sum()


def geometric_median(updates: Tensor, weights: Tensor | None = None, *, nu: float = 1e-6,
                     max_iters: int = 100, tol: float = 1e-7) -> Tensor:
    """RFA's geometric median (Pillutla, Kakade, Harchaoui 2022): argmin_z Σ_i α_i ‖z − x_i‖ by the
    smoothed Weiszfeld iteration z ← Σ β_i x_i / Σ β_i with β_i = α_i / max(ν, ‖z − x_i‖), started at
    the weighted mean. Stops after ``max_iters`` or when the objective improves by less than
    ``tol`` × objective. (The RFA paper uses only ~3 iterations; the default here aims for accuracy.)"""
    weights = _check_updates(updates, weights)
    if nu <= 0 or max_iters < 1 or tol < 0:
        raise ValueError(f"geometric_median needs nu > 0, max_iters >= 1, tol >= 0; got {nu}, {max_iters}, {tol}")
    alpha = _normalised(weights, updates.shape[0], updates)
    z = alpha @ updates
    obj = _geomed_objective(updates, alpha, z)
    for _ in range(max_iters):
        beta = alpha / (updates - z).norm(dim=1).clamp_min(nu)
        z_new = (beta / beta.sum()) @ updates
        obj_new = _geomed_objective(updates, alpha, z_new)
        if obj_new > obj:  # the smoothed step can overshoot by ~ν; keep the better point
            break
        z, improvement, obj = z_new, obj - obj_new, obj_new
        if improvement <= tol * obj:
            break
    return z


def centered_clip(updates: Tensor, weights: Tensor | None = None, *, center: Tensor | None = None,
                  tau: float = 1.0, iters: int = 3) -> Tensor:
    """Centered clipping (Karimireddy, He, Jaggi 2021): starting from v_0 = ``center``, repeat L = ``iters``
    times  v ← v + Σ_i p_i · (x_i − v) · min(1, τ / ‖x_i − v‖)  (p_i = 1/n, or normalised ``weights``).

    The caller should pass the previous round's aggregate as ``center`` (the paper's v^{t−1}). When
    ``center`` is None we start from the coordinate-wise median — a robust stateless stand-in (zeros would
    make the output shrink towards 0 whenever τ is small)."""
    weights = _check_updates(updates, weights)
    if tau <= 0 or iters < 1:
        raise ValueError(f"centered_clip needs tau > 0 and iters >= 1, got tau={tau}, iters={iters}")
    p = _normalised(weights, updates.shape[0], updates)
    if center is None:
        v = _median_rows(updates)
    else:
        v = torch.as_tensor(center, device=updates.device, dtype=updates.dtype)
        if v.shape != updates.shape[1:] or not torch.isfinite(v).all():
            raise ValueError(f"center must be a finite vector of shape [{updates.shape[1]}], got {tuple(v.shape)}")
    for _ in range(iters):
        diff = updates - v
        scale = (tau / diff.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0)
        v = v + (p * scale) @ diff
    return v


# ----------------------------------------------------------------------------------------------------
# FlagAggregator: flag-median subspace by IRLS


def _flag_subspace(gram: Tensor, row_w: Tensor, pair_w: Tensor | None, r: int) -> Tensor:
    """Top-r left singular vectors of A = X̂ B (columns w_i x̂_i and w_ij (x̂_i − x̂_j)) written as Y = X̂ c.

    With G = X̂ᵀX̂ = V S Vᵀ, an orthonormal basis of span(X̂) is Q = X̂ V S^{-1/2}; A = Q K with
    K = S^{1/2} Vᵀ B, so everything reduces to n×n algebra: KKᵀ = S^{1/2} Vᵀ (BBᵀ) V S^{1/2}."""
    bbt = torch.diag(row_w ** 2)
    if pair_w is not None:  # Σ_{i≠j} w_ij² (e_i − e_j)(e_i − e_j)ᵀ over ordered pairs = 2 × graph Laplacian
        w2 = pair_w ** 2
        bbt = bbt + 2.0 * (torch.diag(w2.sum(dim=1)) - w2)
    s, v = torch.linalg.eigh(gram)
    keep = s > s.max() * gram.shape[0] * torch.finfo(gram.dtype).eps
    s, v = s[keep], v[:, keep]
    root = s.sqrt()
    kkt = root[:, None] * (v.T @ bbt @ v) * root[None, :]
    _, u = torch.linalg.eigh(kkt)  # ascending eigenvalues
    u = u[:, -r:] if u.shape[1] >= r else u
    return v @ (u / root[:, None])  # c: Y = X̂ c


def flag_aggregator(updates: Tensor, weights: Tensor | None = None, *, r: int = 1, lam: float = 0.0,
                    iters: int = 5, eps: float = 1e-7, rescale: bool = False) -> Tensor:
    """FlagAggregator (Almasi et al., ICLR 2024), following the official ``aggregators/flag.py``.

    1. normalise x̂_i = x_i / ‖x_i‖;
    2. find an orthonormal Y ∈ ℝ^{d×r} minimising the flag-median ("sine median") objective
       Σ_i sqrt(1 − ‖Yᵀx̂_i‖²) (+ λ pairwise terms) by IRLS: weights w_i = (|1 − ‖Yᵀx̂_i‖²| + ε)^{-1/4},
       Y ← top-r left singular vectors of [w_1 x̂_1, …, w_n x̂_n, (λ/(n(n−1))) w_ij (x̂_i − x̂_j)];
       an iteration that does not lower the objective is undone (as in the repo's ``irls_flag``);
    3. output Σ_i Y Yᵀ x̂_i / r — built from *normalised* updates, so its norm is not the clients' scale.

    Differences from the repo: the repo starts from a random Y and runs 1 IRLS iteration; here Y starts
    at the flag mean (w_i = 1, the deterministic limit of that first step) and ``iters`` iterations follow.
    ``rescale=True`` multiplies the output by median_i ‖x_i‖ / ‖output‖ (our option, not the paper's).
    Ignores ``weights``. Zero rows contribute nothing."""
    _check_updates(updates, weights)
    n = updates.shape[0]
    if r < 1 or lam < 0 or iters < 0 or eps <= 0:
        raise ValueError(f"flag_aggregator needs r >= 1, lam >= 0, iters >= 0, eps > 0; got {r}, {lam}, {iters}, {eps}")
    norms = updates.norm(dim=1)
    xhat = updates / norms.clamp_min(torch.finfo(updates.dtype).tiny)[:, None]
    gram = xhat @ xhat.T
    if gram.abs().max() == 0:  # every update is zero
        return torch.zeros_like(updates[0])

    def cos2(c):  # ‖Yᵀx̂_i‖² for Y = X̂ c
        return ((gram @ c) ** 2).sum(dim=1)

    def objective(c):
        return (1.0 - cos2(c)).clamp_min(0.0).sqrt().sum()

    c = _flag_subspace(gram, torch.ones(n, dtype=gram.dtype, device=gram.device), None, r)
    obj = objective(c)
    for _ in range(iters):
        w = ((1.0 - cos2(c)).abs() + eps) ** -0.25
        pair_w = None
        if lam > 0 and n > 1:  # ‖Yᵀ(x̂_i − x̂_j)‖² from projections of the rows
            proj = gram @ c  # [n, r] = (Yᵀx̂_i)ᵀ
            pd2 = ((proj[:, None, :] - proj[None, :, :]) ** 2).sum(dim=2)
            pair_w = ((1.0 - pd2).abs() + eps) ** -0.25 * (lam / (n * (n - 1)))
            pair_w.fill_diagonal_(0.0)
        c_new = _flag_subspace(gram, w, pair_w, r)
        obj_new = objective(c_new)
        if obj_new >= obj:
            break
        c, obj = c_new, obj_new
    # Σ_i Y Yᵀ x̂_i / r with Y = X̂ c:  X̂ c cᵀ G 1 / r
    out = (c @ (c.T @ gram.sum(dim=1))) @ xhat / r
    if rescale and out.norm() > 0:
        out = out * (norms.median() / out.norm())
    return out


# ----------------------------------------------------------------------------------------------------
# GAS: gradient splitting around any base rule


def gas(updates: Tensor, weights: Tensor | None = None, *, base_rule: str | Callable = "coordinate_median",
        p: int = 16, f: int = 0, split: str = "random", generator: torch.Generator | None = None,
        base_hyper: dict | None = None) -> Tensor:
    """GAS (Liu et al., ICML 2023), as in the official ``server/base.py``:

    1. split the d coordinates into p groups (``split="random"``: a random permutation chunked into p
       near-equal groups, the repo's choice, drawn from ``generator`` (a CPU ``torch.Generator``; None uses
       torch's global RNG); ``"contiguous"``: consecutive blocks);
    2. per group j, aggregate with the base rule: a^(j) = AGR(x_1^(j), …, x_n^(j));
    3. identification score s_i = Σ_j ‖x_i^(j) − a^(j)‖ (plain, not squared, L2 distance);
    4. keep the n − f lowest-scoring clients and return their mean (weighted if ``weights``; uniform if
       every kept client has weight 0).

    ``base_rule`` is a registry name or a callable rule; ``base_hyper`` its hyperparameters. If the base
    rule takes ``f`` and ``base_hyper`` does not set it, GAS's ``f`` is passed. With p = 1 this is "keep the
    n − f clients closest to AGR(x) and average them". Needs p ≥ 1 and f < n/2."""
    weights = _check_updates(updates, weights)
    n, d = updates.shape
    if isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1:
        raise ValueError(f"gas needs an integer number of groups p >= 1, got p={p!r}")
    _check_f(f, n, "f < n/2", 2 * f < n, f"lower f below {n / 2} or use more clients")
    if split not in ("random", "contiguous"):
        raise ValueError(f"gas split must be 'random' or 'contiguous', got {split!r}")
    rule = RULES[base_rule] if isinstance(base_rule, str) and base_rule in RULES else base_rule
    if isinstance(rule, str) or not callable(rule):
        raise ValueError(f"gas base_rule must be a rule name in {sorted(RULES)} or a callable, got {base_rule!r}")
    hyper = dict(base_hyper or {})
    if "f" in inspect.signature(rule).parameters and "f" not in hyper:
        hyper["f"] = f
    if split == "random":
        order = torch.randperm(d, generator=generator, device="cpu").to(updates.device)
    else:
        order = torch.arange(d, device=updates.device)
    scores = updates.new_zeros(n)
    for group in torch.tensor_split(order, min(p, d)):  # p base-rule calls, each on an [n, d/p] slice
        block = updates[:, group]
        scores += (block - rule(block, **hyper)).norm(dim=1)
    kept = scores.sort(stable=True).indices[:n - f]
    w = None if weights is None else weights[kept]
    if w is not None and w.sum() <= 0:
        w = None
    return _normalised(w, n - f, updates) @ updates[kept]


# ----------------------------------------------------------------------------------------------------
# FLTrust: server-side reference update


def fltrust(updates: Tensor, weights: Tensor | None = None, *, server_update: Tensor | None = None) -> Tensor:
    """FLTrust (Cao et al., NDSS 2021) with server update g_0 (computed on the server's root dataset):
    trust TS_i = ReLU(cos(x_i, g_0)); each x_i is rescaled to ‖g_0‖; output Σ TS_i x̄_i / Σ TS_i.
    If every trust score is 0 (all updates point away from g_0, or g_0 = 0) the output is zeros.
    Ignores ``weights`` (the trust scores are the weights)."""
    _check_updates(updates, weights)
    if server_update is None:
        raise ValueError("fltrust needs server_update=g0 (the server's update on its root data); "
                         "pass it per round: fltrust(updates, server_update=g0)")
    g0 = torch.as_tensor(server_update, device=updates.device, dtype=updates.dtype)
    if g0.shape != updates.shape[1:] or not torch.isfinite(g0).all():
        raise ValueError(f"server_update must be a finite vector of shape [{updates.shape[1]}], got {tuple(g0.shape)}")
    g0_norm = g0.norm()
    norms = updates.norm(dim=1)
    tiny = torch.finfo(updates.dtype).tiny
    trust = torch.relu((updates @ g0) / (norms * g0_norm).clamp_min(tiny))
    if trust.sum() <= 0:
        return torch.zeros_like(g0)
    rescaled = updates * (g0_norm / norms.clamp_min(tiny))[:, None]
    return (trust / trust.sum()) @ rescaled


# ----------------------------------------------------------------------------------------------------
# Registry


_drop_nonfinite = drop_nonfinite  # get_rule's keyword of the same name shadows it

RULES: dict[str, Callable[..., Tensor]] = {
    "mean": mean,
    "coordinate_median": coordinate_median,
    "median": coordinate_median,
    "trimmed_mean": trimmed_mean,
    "krum": krum,
    "multi_krum": multi_krum,
    "bulyan": bulyan,
    "geometric_median": geometric_median,
    "rfa": geometric_median,
    "centered_clip": centered_clip,
    "cc": centered_clip,
    "flag_aggregator": flag_aggregator,
    "flag": flag_aggregator,
    "gas": gas,
    "fltrust": fltrust,
}


def _unknown(kind: str, name, valid) -> ValueError:
    close = difflib.get_close_matches(str(name), list(valid), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}.{hint} Valid names: {', '.join(sorted(valid))}")


def get_rule(name: str, *, drop_nonfinite: bool = False, **hyper) -> Callable[..., Tensor]:
    """Rule ``name`` with its hyperparameters bound: returns ``agg(updates, weights=None) -> Tensor[d]``.

    ``drop_nonfinite=True`` removes client rows with NaN/Inf before aggregating (instead of raising).
    Unknown names or hyperparameters raise ``ValueError`` listing what is valid."""
    if name not in RULES:
        raise _unknown("aggregation rule", name, RULES)
    rule = RULES[name]
    allowed = [k for k, prm in inspect.signature(rule).parameters.items() if prm.kind is prm.KEYWORD_ONLY]
    wrong = [k for k in hyper if k not in allowed]
    if wrong:
        raise ValueError(f"rule {name!r} has no hyperparameter(s) {wrong}; valid: {allowed}")
    bound = functools.partial(rule, **hyper)
    if not drop_nonfinite:
        return bound

    @functools.wraps(rule)
    def robust_to_nan(updates: Tensor, weights: Tensor | None = None) -> Tensor:
        kept_updates, kept_weights, _ = _drop_nonfinite(updates, weights)
        return bound(kept_updates, kept_weights)

    return robust_to_nan
