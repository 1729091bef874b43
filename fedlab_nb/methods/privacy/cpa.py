"""Cocktail Party Attack (CPA): gradient inversion from an *aggregated* gradient by blind source separation.

Kariyappa, Guo, Maeng, Xiong, Suh, Qureshi, Lee, "Cocktail Party Attack: Breaking Aggregation-Based Privacy in
Federated Learning using Independent Component Analysis", ICML 2023, https://arxiv.org/abs/2209.05578;
official code https://github.com/facebookresearch/cocktail_party_attack.

The weight gradient of a fully connected layer z = W x + b over a batch X (B × d) is

    G = ∇_W L = Δᵀ X        (h × d),   Δ = ∂L/∂z  (B × h),    ∇_b L = Δᵀ 1,

so every row of G is a linear mixture of the B inputs: a blind source separation ("cocktail party") problem.
CPA centres and whitens G (top-B principal directions), then optimises an unmixing matrix U (B × B, unit-norm
rows) with Adam to maximise the non-Gaussianity of the unmixed rows (negentropy, log-cosh approximation) under
an image prior (total variation) and a mutual-independence penalty exp(T·|cos(u_i, u_j)|) that keeps the rows
apart:   min_U  −mean_i J(u_i X_w) + λ_TV · TV(U W G) + λ_MI · mean_ij (exp(T |cos(u_i, u_j)|) − 1).
The inputs come back up to order, sign and scale (ICA's ambiguities); the paper's evaluation matches them to the
originals and picks the better sign, as `align` does here. With B = 1 no ICA is needed: G = δ xᵀ and
∇_b = δ, so x = G_k / (∇_b)_k for any row k (`invert_single`).

Secure aggregation gives the server Σ_k G_k = [Δ_1; …; Δ_K]ᵀ [X_1; …; X_K]: the gradient of the union batch,
the same kind of mixture, so CPA applies unchanged. DP noise on the aggregate (`dp_fc_gradient`) is what hurts it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from fedlab_nb.core.registry import register
from fedlab_nb.core.streams import register_stream
from fedlab_nb.methods.privacy.dp import check_noise, check_positive

CPA_STREAM = register_stream("cpa", 25)  # the random-unmixing baseline's draws and the DP noise of the notebook
GAUSS_LOGCOSH = 0.3745672075  # E[log cosh ν], ν ~ N(0, 1): the Gaussian reference of the negentropy approximation


def keyed_generator(seed: int, *keys: int) -> torch.Generator:
    """A torch.Generator keyed by (seed, CPA's stream id, *keys): batches, baselines and DP noise of one
    experiment never share draws, and `seed + 10` moves all of them."""
    state = np.random.SeedSequence([int(seed), CPA_STREAM, *map(int, keys)]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


# --- what the server sees ------------------------------------------------------------------------------------
def first_linear(model: nn.Module) -> nn.Linear:
    """The first fully connected layer of `model` (the layer CPA attacks)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return m
    raise ValueError("model has no nn.Linear layer; CPA needs a fully connected first layer (e.g. make_model('mlp', ...))")


def _check_batch(x: torch.Tensor, y: torch.Tensor):
    if x.ndim != 2:
        raise ValueError(f"x must be a [B, d] matrix of flattened inputs, got shape {tuple(x.shape)}")
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must hold one label per row of x: expected shape ({x.shape[0]},), got {tuple(y.shape)}")


def fc_gradient_matrix(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
    """(∇_W L, ∇_b L) of the first Linear layer for the batch (x [B, d], y [B]) under cross-entropy: what one
    client uploads for that layer in FedSGD. `reduction="sum"` makes the gradients of disjoint batches add up to
    the union batch's exactly."""
    _check_batch(x, y)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    layer = first_linear(model)
    loss = nn.functional.cross_entropy(model(x), y, reduction=reduction)
    gw, gb = torch.autograd.grad(loss, [layer.weight, layer.bias])
    return gw.detach(), gb.detach()


def first_layer_deltas(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Δ = ∂L/∂z (B × h) at the first Linear layer's output: the mixing matrix of G = Δᵀ X (for tests and figures)."""
    _check_batch(x, y)
    layer, out = first_linear(model), {}
    hook = layer.register_forward_hook(lambda m, i, o: out.setdefault("z", o))
    try:
        loss = nn.functional.cross_entropy(model(x), y, reduction=reduction)
    finally:
        hook.remove()
    return torch.autograd.grad(loss, out["z"])[0].detach()


def dp_fc_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, noise_multiplier: float,
                   generator: torch.Generator | None = None):
    """The first layer's part of a DP-SGD aggregate: every per-sample gradient (all parameters) clipped to L2 norm
    `clip`, summed, Gaussian noise N(0, (z·clip)²) added per coordinate, divided by B (Abadi et al. 2016)."""
    from torch.func import functional_call, grad, vmap
    _check_batch(x, y)
    clip = check_positive("clip", clip, "the per-sample L2 bound, e.g. clip=1.0")
    noise_multiplier = check_noise(noise_multiplier)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(g.reshape(len(x), -1).pow(2).sum(1) for g in per.values()))
    scale = (clip / (norms + 1e-12)).clamp(max=1.0)
    names = [n for n, p in model.named_parameters() if p is first_linear(model).weight or p is first_linear(model).bias]
    out = []
    for n in names:  # weight then bias of the first layer
        s = (per[n] * scale.view(-1, *[1] * (per[n].ndim - 1))).sum(0)
        noise = torch.randn(s.shape, generator=generator, dtype=s.dtype) * noise_multiplier * clip
        out.append((s + noise) / len(x))
    return tuple(out)


SECAGG_PRIME = 2**61 - 1  # a Mersenne prime: sums of two residues stay below 2^62, no int64 overflow


def secure_sum(gradients, seed: int, frac_bits: int = 40):
    """Secure aggregation's arithmetic (Bonawitz et al., CCS 2017, without dropouts): every client encodes its tensor
    in fixed point (`frac_bits` fractional bits) modulo a prime p and adds pairwise masks m_ij (uniform mod p) that
    cancel in the sum. Returns (the decoded sum, the masked messages as residues): the server learns the sum of the
    encoded gradients exactly, and each message alone is uniform noise."""
    p, one = SECAGG_PRIME, 2.0 ** frac_bits
    grads = [torch.as_tensor(g, dtype=torch.float64) for g in gradients]
    if len(grads) < 2 or any(g.shape != grads[0].shape for g in grads):
        raise ValueError("gradients must be at least two tensors of one shape (one per client)")
    if max(float(g.abs().max()) for g in grads) * one * len(grads) >= p / 2:
        raise ValueError(f"values too large for {frac_bits} fractional bits modulo 2^61 - 1; lower frac_bits")
    k = len(grads)
    masks = {(i, j): torch.randint(0, p, grads[0].shape, generator=keyed_generator(seed, 8, i, j), dtype=torch.int64)
             for i in range(k) for j in range(i + 1, k)}
    messages = []
    for i, g in enumerate(grads):
        msg = torch.remainder(torch.round(g * one).to(torch.int64), p)
        for j in range(k):
            if j != i:  # client i adds m_ij for j > i and subtracts m_ji for j < i
                msg = torch.remainder(msg + (masks[i, j] if j > i else p - masks[j, i]), p)
        messages.append(msg)
    total = messages[0]
    for msg in messages[1:]:
        total = torch.remainder(total + msg, p)
    signed = torch.where(total > p // 2, total - p, total)
    return signed.to(torch.float64) / one, messages


# --- B = 1: exact ----------------------------------------------------------------------------------------------
def invert_single(grad_w: torch.Tensor, grad_b: torch.Tensor) -> torch.Tensor:
    """The input of a batch of one from its first-layer gradients: G = δ xᵀ and ∇_b = δ, so row k of G divided
    by δ_k is x. Uses the row with the largest |δ_k| (the best-conditioned division)."""
    if grad_w.ndim != 2 or grad_b.shape != (grad_w.shape[0],):
        raise ValueError(f"grad_w must be [h, d] and grad_b [h]; got {tuple(grad_w.shape)} and {tuple(grad_b.shape)}")
    k = int(grad_b.abs().argmax())
    if grad_b[k] == 0:
        raise ValueError("grad_b is all zero (no unit is active): the input cannot be read off this gradient")
    return grad_w[k] / grad_b[k]


# --- B > 1: blind source separation ---------------------------------------------------------------------------
def whiten(G: torch.Tensor, batch_size: int):
    """Centre each row of G over its d entries and project on the top-`batch_size` principal directions, scaled
    to unit variance: returns (X_w [B, d], W_w [B, h]) with X_w = W_w (G − row means)."""
    G = torch.as_tensor(G)
    if G.ndim != 2:
        raise ValueError(f"G must be the [h, d] weight gradient of a fully connected layer, got shape {tuple(G.shape)}")
    h, d = G.shape
    if not (isinstance(batch_size, int) and 1 <= batch_size):
        raise ValueError(f"batch_size must be a positive int (the number of inputs mixed in G), got {batch_size!r}")
    if batch_size > min(h, d):
        raise ValueError(f"batch_size {batch_size} exceeds the layer's h = {h} (or d = {d}): G has rank <= min(h, d), so "
                         f"at most that many inputs can be separated; widen the first layer (h >= B)")
    Gc = G - G.mean(dim=1, keepdim=True)
    evals, evecs = torch.linalg.eigh(Gc @ Gc.T / (d - 1))
    top = torch.argsort(evals, descending=True)[:batch_size]
    W_w = evecs[:, top].T / torch.sqrt(evals[top].clamp_min(1e-30))[:, None]
    return W_w @ Gc, W_w


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between neighbouring pixels, across and down ([B, H, W] images)."""
    return (images[:, :, 1:] - images[:, :, :-1]).abs().mean() + (images[:, 1:, :] - images[:, :-1, :]).abs().mean()


def _negentropy(S: torch.Tensor) -> torch.Tensor:
    """Hyvärinen's approximation J(s) ≈ (E log cosh s − E log cosh ν)² per unit-variance row of S."""
    logcosh = S.abs() + torch.log1p(torch.exp(-2 * S.abs())) - math.log(2.0)  # overflow-free log cosh
    return (logcosh.mean(dim=1) - GAUSS_LOGCOSH) ** 2


@register("cpa", claims="cpa", kind="module")
def cocktail_party_attack(G: torch.Tensor, batch_size: int, *, image_shape=None, ne_weight: float = 1.0,
                          tv_weight: float = 10.0, decor_weight: float = 0.1, temperature: float = 5.0,
                          steps: int = 300, lr: float = 0.03, generator: torch.Generator | None = None,
                          return_unmixing: bool = False):
    """Recover the `batch_size` inputs mixed in a first-layer weight gradient G (h × d) — CPA, Kariyappa et al. 2023.

    Whitens G (`whiten`), then runs `steps` Adam steps (learning rate `lr`) on the unmixing matrix U (B × B, rows
    normalised to unit length, so every unmixed row has unit variance) minimising
    −ne_weight · mean J(U X_w) + tv_weight · TV(U W_w G) + decor_weight · mean(exp(temperature · |U Uᵀ|) − 1).
    The defaults were picked, as the paper picks its own, by a sweep on ONE held-out batch (Fashion-MNIST, B = 32,
    MLP 784-256-10; grid ne ∈ {0, 1, 10, 100}, tv ∈ {0.3, 1, 3.1, 10}, decor ∈ {0.1, 1.47, 5}, T ∈ {5, 12.4});
    the official Tiny-ImageNet FC-2 run uses tv 3.1, decor 1.47, T 12.4, lr 1e-3, 25,000 steps. On images the TV
    prior does the separating; without a prior (tv_weight=0) the negentropy must outweigh the penalty (e.g.
    ne_weight=100 with decor_weight=0.1) for the ICA term to move U away from the principal components.
    `image_shape` (H, W) reshapes rows for the TV prior (None, or tv_weight = 0: no prior). U starts at the identity
    (the principal components), as in the official code, or at a random orthogonal matrix when `generator` is given.
    Returns the recovered inputs [B, d] (order, sign and scale unknown; use `align` / `matched_correlation`)."""
    X_w, W_w = whiten(G, batch_size)
    G = torch.as_tensor(G, dtype=X_w.dtype)
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if tv_weight and image_shape is not None and math.prod(image_shape) != G.shape[1]:
        raise ValueError(f"image_shape {tuple(image_shape)} has {math.prod(image_shape)} pixels but G has d = {G.shape[1]} "
                         "columns; pass the input's (H, W)")
    B = batch_size
    U0 = torch.eye(B, dtype=X_w.dtype) if generator is None else random_orthogonal(B, generator).to(X_w.dtype)
    U = U0.clone().requires_grad_(True)
    opt = torch.optim.Adam([U], lr=lr)
    mean_part = W_w @ G.mean(dim=1, keepdim=True)  # undo the centering: rows are u_i W_w G
    for _ in range(steps):
        opt.zero_grad()
        Un = U / U.norm(dim=1, keepdim=True)
        S = Un @ X_w
        loss = -ne_weight * _negentropy(S).mean()
        if decor_weight:
            loss = loss + decor_weight * (torch.exp(temperature * (Un @ Un.T).abs()) - 1).mean()
        if tv_weight and image_shape is not None:
            loss = loss + tv_weight * total_variation((S + Un @ mean_part).reshape(B, *image_shape))
        loss.backward()
        opt.step()
    with torch.no_grad():
        Un = U / U.norm(dim=1, keepdim=True)
        rec = Un @ X_w + Un @ mean_part
    return (rec, Un @ W_w) if return_unmixing else rec


def random_orthogonal(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A Haar-random n × n orthogonal matrix (QR of a Gaussian matrix with the sign fix of Mezzadri 2007)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def random_unmixing(G: torch.Tensor, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Baseline: the same whitening, then a random orthogonal unmixing instead of ICA."""
    X_w, W_w = whiten(G, batch_size)
    U = random_orthogonal(batch_size, generator).to(X_w.dtype)
    return U @ W_w @ torch.as_tensor(G, dtype=X_w.dtype)


def fastica_unmixing(G: torch.Tensor, batch_size: int, seed: int = 0, max_iter: int = 400) -> torch.Tensor:
    """Baseline: scikit-learn's FastICA (log-cosh, unit-variance whitening) on G, pixels as samples, rows as
    mixtures; no image prior. Returns [B, d] (centered sources)."""
    import warnings

    from sklearn.decomposition import FastICA
    from sklearn.exceptions import ConvergenceWarning
    X_w, _ = whiten(G, batch_size)  # validates the arguments the same way
    ica = FastICA(n_components=batch_size, whiten="unit-variance", fun="logcosh", max_iter=max_iter, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        S = ica.fit_transform(torch.as_tensor(G, dtype=torch.float64).numpy().T)
    return torch.as_tensor(S.T, dtype=X_w.dtype)


# --- scoring ---------------------------------------------------------------------------------------------------
class Match(NamedTuple):
    mean: float            # mean matched |corr| over the true inputs
    per_input: np.ndarray  # |corr| of each true input with its matched recovery [B]
    index: np.ndarray      # index[i] = the recovered row matched to true input i
    sign: np.ndarray       # sign of that correlation (+1 / −1)


def _as_rows(a) -> np.ndarray:
    a = torch.as_tensor(a).detach().to(torch.float64).cpu().numpy()
    return a.reshape(a.shape[0], -1)


def correlation_matrix(recovered, true) -> np.ndarray:
    """Pearson correlation C[i, j] between true input i and recovered row j."""
    R, T = _as_rows(recovered), _as_rows(true)
    if R.shape[1] != T.shape[1]:
        raise ValueError(f"recovered rows have {R.shape[1]} entries but true inputs {T.shape[1]}")
    R = R - R.mean(1, keepdims=True)
    T = T - T.mean(1, keepdims=True)
    R /= np.linalg.norm(R, axis=1, keepdims=True) + 1e-30
    T /= np.linalg.norm(T, axis=1, keepdims=True) + 1e-30
    return T @ R.T


def matched_correlation(recovered, true) -> Match:
    """One-to-one matching of recovered rows to true inputs maximising the total |Pearson correlation|
    (Hungarian algorithm, scipy's linear_sum_assignment); invariant to order, sign and scale of the recovery."""
    from scipy.optimize import linear_sum_assignment
    C = correlation_matrix(recovered, true)
    if C.shape[1] < C.shape[0]:
        raise ValueError(f"{C.shape[1]} recovered rows cannot be matched one-to-one to {C.shape[0]} true inputs")
    rows, cols = linear_sum_assignment(-np.abs(C))
    per = np.abs(C[rows, cols])
    return Match(float(per.mean()), per, cols, np.sign(C[rows, cols]))


def align(recovered, true, match: Match | None = None) -> np.ndarray:
    """Recovered rows in the order of the true inputs, with the better sign, min-max scaled to [0, 1] per image
    (the paper's evaluation: reorder, fix the sign, normalise)."""
    match = match or matched_correlation(recovered, true)
    R = _as_rows(recovered)[match.index] * match.sign[:, None]
    lo, hi = R.min(1, keepdims=True), R.max(1, keepdims=True)
    return (R - lo) / np.where(hi > lo, hi - lo, 1.0)


def image_quality(recovered, true, image_shape, match: Match | None = None) -> dict:
    """Per-image PSNR and SSIM (scikit-image, data range 1) of the aligned recovery against true images in [0, 1]."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    A, T = align(recovered, true, match), _as_rows(true)
    A, T = A.reshape(-1, *image_shape), T.reshape(-1, *image_shape)
    psnr = np.array([peak_signal_noise_ratio(t, a, data_range=1.0) for t, a in zip(T, A)])
    ssim = np.array([structural_similarity(t, a, data_range=1.0) for t, a in zip(T, A)])
    return {"psnr": psnr, "ssim": ssim}
