"""Gradient inversion: the server (or an eavesdropper) reconstructs a client's images from its gradient.

Three attacks, each as its paper defines it, on any of the project's models (`make_model("mlp" | "cnn")`),
written with `torch.func.functional_call` / `grad` so the attacker differentiates *through* the victim's
gradient computation:

- **DLG** — Zhu, Liu, Han, "Deep Leakage from Gradients", NeurIPS 2019 (code: mit-han-lab/dlg). Dummy
  input x' ~ N(0, 1) and dummy label logits y' ~ N(0, 1); minimise ‖∇_θ ℓ(f(x'), softmax(y')) − ∇_θ ℓ(f(x), y)‖²
  over both with L-BFGS (300 steps in the official code).
- **iDLG label inference** — Zhao, Mopuri, Bilen, "iDLG: Improved Deep Leakage from Gradients", 2020. For one
  sample with cross-entropy, ∂ℓ/∂b_i = p_i − y_i of the last layer's bias is negative only at the true
  label (and ∂ℓ/∂W_i = (p_i − y_i)·h has non-positive entries only there when h ≥ 0, as after ReLU).
- **Inverting Gradients** — Geiping, Bauermeister, Dröge, Moeller, NeurIPS 2020 (code:
  JonasGeiping/invertinggradients). Loss 1 − ⟨∇θ', ∇θ⟩ / (‖∇θ'‖‖∇θ‖) over the whole parameter gradient plus
  α·TV(x') (anisotropic TV: mean absolute neighbour differences); Adam on x' with *signed* gradients,
  lr 0.1 cut ×0.1 at 3/8, 5/8 and 7/8 of the iterations, x' projected into the data box after each step,
  labels given (or iDLG for one image); best of `restarts` by the final matching loss.
  `reconstruct_from_update` inverts a multi-step local update θ_E − θ_0 instead (the paper's FedAvg setting),
  unrolling the client's E differentiable SGD steps.

Quality: PSNR and SSIM from scikit-image; for a batch the order is lost, so each recovered image is
matched to an original by the Hungarian assignment on the MSE (scipy's `linear_sum_assignment`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from torch import nn
from torch.func import functional_call, grad

from ...core.registry import register
from ...core.streams import register_stream
from ...utils import rng
from .dp import check_noise, check_positive

INVERSION = register_stream("gradient_inversion", 24)   # dummy-input initialisation and defence noise


# --- what the client sends ------------------------------------------------------------------------------
def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as a detached name → tensor dict (the global model θ the client received)."""
    return {n: p.detach() for n, p in model.named_parameters()}


def _loss(model, params, x, y):
    """Mean cross-entropy; `y` holds class indices [B] or (soft) label distributions [B, C]."""
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def client_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, params: dict | None = None) -> dict:
    """∇_θ of the mean cross-entropy of the batch (x, y): the message of FedSGD. Differentiable in x and y
    (torch.func.grad composes with autograd), which is what every attack below relies on."""
    params = parameters_of(model) if params is None else params
    return grad(lambda p: _loss(model, p, x, y))(params)


def client_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, local_steps: int, local_lr: float,
                  local_batch: int | None = None, params: dict | None = None) -> dict:
    """θ_E − θ_0 after `local_steps` SGD steps on the client's batch (FedAvg's upload), differentiable in x.
    With `local_batch` = b, step i uses the ((i mod B/b))-th slice of b rows, as the official code cycles them."""
    _check_steps(local_steps, local_lr)
    theta0 = parameters_of(model) if params is None else params
    b = x.shape[0] if local_batch is None else int(local_batch)
    if not 1 <= b <= x.shape[0]:
        raise ValueError(f"local_batch must be in [1, {x.shape[0]}] (the batch size), got {local_batch}")
    theta, n_slices = dict(theta0), x.shape[0] // b
    for i in range(local_steps):
        j = (i % n_slices) * b
        g = client_gradient(model, x[j:j + b], y[j:j + b], theta)
        theta = {k: theta[k] - local_lr * g[k] for k in theta}
    return {k: theta[k] - theta0[k] for k in theta}


def _check_steps(local_steps, local_lr):
    if int(local_steps) < 1 or not local_lr > 0:
        raise ValueError(f"need local_steps >= 1 and local_lr > 0, got local_steps={local_steps}, local_lr={local_lr}")


# --- defences (what the server may see instead) ---------------------------------------------------------
def clip_and_noise(message: dict, clip: float, noise_multiplier: float, generator: torch.Generator) -> dict:
    """DP-FedAvg's client step (McMahan et al., ICLR 2018): scale the whole message to L2 norm ≤ `clip`,
    then add N(0, (z·clip)²) to every coordinate — what an attacker sees of one client when z > 0."""
    clip = check_positive("clip", clip, "the L2 bound of a client's message, e.g. clip=1.0")
    noise_multiplier = check_noise(noise_multiplier)
    norm = torch.sqrt(sum((v ** 2).sum() for v in message.values()))
    scale = min(1.0, clip / max(float(norm), 1e-12))
    sd = noise_multiplier * clip
    return {k: v * scale + sd * torch.randn(v.shape, generator=generator, dtype=v.dtype).to(v.device)
            for k, v in message.items()}


def secure_sum(messages: list[dict]) -> dict:
    """The sum of the clients' messages: all that secure aggregation reveals to the server."""
    if not messages:
        raise ValueError("secure_sum needs at least one client's message")
    return {k: sum(m[k] for m in messages) for k in messages[0]}


# --- label inference (iDLG) -----------------------------------------------------------------------------
def _last_layer(model: nn.Module, target: dict):
    """(weight gradient [C, h], bias gradient [C] or None) of the model's last nn.Linear."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear output layer; label inference needs one")
    name = linears[-1]
    if f"{name}.weight" not in target:
        raise ValueError(f"the target gradient has no entry {name}.weight; pass the full parameter gradient")
    return target[f"{name}.weight"], target.get(f"{name}.bias")


def infer_labels(model: nn.Module, target: dict, batch_size: int = 1) -> torch.Tensor:
    """Labels from the last layer's gradient, without any optimisation.

    B = 1 (iDLG): the bias gradient p − onehot(y) is negative only at y, so y = argmin; without a bias the
    row sums of the weight gradient (p_i − y_i)·Σh are used (h ≥ 0 after ReLU), as the official IG code does.
    B > 1: every class absent from the batch has bias gradient mean_b p_bi > 0, so only present classes can
    be negative; we return the B most negative classes — exact only when the labels are distinct and each
    present class's share 1/B exceeds its mean predicted probability (our own sign argument, not a paper's
    rule; it returns sorted labels, since order is lost)."""
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    w, b = _last_layer(model, target)
    score = b if b is not None else w.sum(dim=-1)
    if batch_size > score.numel():
        raise ValueError(f"batch_size {batch_size} > {score.numel()} classes: the sign rule only finds distinct "
                         "labels; pass labels= to the attack instead")
    return torch.sort(torch.topk(-score, int(batch_size)).indices).values


# --- gradient-matching losses ---------------------------------------------------------------------------
def l2_distance(trial: dict, target: dict) -> torch.Tensor:
    """DLG's ‖∇θ' − ∇θ‖², summed over every parameter tensor."""
    return sum(((trial[k] - target[k]) ** 2).sum() for k in target)


def cosine_distance(trial: dict, target: dict) -> torch.Tensor:
    """IG's 1 − cos(∇θ', ∇θ), with the inner product and norms taken over the whole parameter vector."""
    dot = sum((trial[k] * target[k]).sum() for k in target)
    n1 = sum((trial[k] ** 2).sum() for k in target)
    n2 = sum((target[k] ** 2).sum() for k in target)
    return 1 - dot / (n1.sqrt() * n2.sqrt())


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV of images [B, C, H, W]: mean |horizontal difference| + mean |vertical difference|."""
    return (x[..., :, 1:] - x[..., :, :-1]).abs().mean() + (x[..., 1:, :] - x[..., :-1, :]).abs().mean()


# --- the attacks -----------------------------------------------------------------------------------------
@dataclass
class Reconstruction:
    """What an attack returns: images [B, C, H, W] (in the data's box after IG), labels (indices for
    IG; the argmax of the optimised soft labels for DLG) and the final matching loss."""
    images: torch.Tensor
    labels: torch.Tensor
    loss: float
    losses: list = field(default_factory=list)


def _check_target(model, target, input_shape, batch_size):
    names = [n for n, _ in model.named_parameters()]
    if not isinstance(target, dict) or sorted(target) != sorted(names):
        raise ValueError("target must be a dict with one gradient tensor per model parameter "
                         f"({len(names)} names, e.g. {names[:2]}); build it with client_gradient(...)")
    if len(tuple(input_shape)) != 3:
        raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def generator(seed: int, purpose: int = 0) -> torch.Generator:
    """A torch generator keyed by (seed, stream 24, purpose): 0 = the attacker's dummy inputs, 1 = defence noise."""
    return torch.Generator().manual_seed(int(rng(seed, INVERSION, purpose).integers(2 ** 62)))


def _device_of(message: dict) -> torch.device:
    return next(iter(message.values())).device   # dummy inputs live where the observed gradient does


def _flat_input(x, input_shape):
    return x.reshape(x.shape[0], -1) if len(input_shape) == 3 else x


def dlg(model: nn.Module, target: dict, input_shape, batch_size: int = 1, iterations: int = 300,
        lr: float = 1.0, labels: torch.Tensor | None = None, seed: int = 0, history_every: int = 0) -> Reconstruction:
    """Deep Leakage from Gradients: L-BFGS on (x', y') minimising the L2 gradient distance, the labels soft
    (softmax of optimised logits) unless `labels` is given (then only x' moves, as iDLG does)."""
    _check_target(model, target, input_shape, batch_size)
    params = parameters_of(model)
    target = {k: v.detach() for k, v in target.items()}
    num_classes = _last_layer(model, target)[0].shape[0]
    g, dev = generator(seed), _device_of(target)
    labels = None if labels is None else torch.as_tensor(labels).to(dev)
    x = torch.randn(batch_size, *input_shape, generator=g).to(dev).requires_grad_(True)
    y_logits = torch.randn(batch_size, num_classes, generator=g).to(dev).requires_grad_(labels is None)
    leaves = [x] + ([y_logits] if labels is None else [])
    opt = torch.optim.LBFGS(leaves, lr=lr)

    def objective():
        y = F.softmax(y_logits, dim=-1) if labels is None else labels
        return l2_distance(client_gradient(model, _flat_input(x, input_shape), y, params), target)

    def closure():
        opt.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    losses = []
    for _ in range(int(iterations)):
        last = (x.detach().clone(), y_logits.detach().clone())
        losses.append(opt.step(closure).item())
        if not (np.isfinite(losses[-1]) and torch.isfinite(x).all()):
            with torch.no_grad():   # L-BFGS diverged: keep the last finite iterate, stop
                x.copy_(last[0]), y_logits.copy_(last[1])
            break
    with torch.no_grad():
        final = float(objective())
    out_labels = y_logits.argmax(-1).detach() if labels is None else labels
    return Reconstruction(x.detach(), out_labels, final, losses)


def _ig_optimise(match, input_shape, batch_size, iterations, lr, tv, signed, box, restarts, seed, device):
    """IG's optimiser: Adam on x' (signed gradients), MultiStepLR ×0.1 at 3/8, 5/8, 7/8, box projection;
    the restart with the lowest final loss wins. `match(x)` returns the gradient-matching term."""
    g = generator(seed)
    best = None
    lo, hi = box
    for _ in range(int(restarts)):
        x = torch.randn(batch_size, *input_shape, generator=g).to(device).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr)
        n = int(iterations)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(n // 2.667), int(n // 1.6), int(n // 1.142)], 0.1)
        losses = []
        for _ in range(n):
            opt.zero_grad()
            loss = match(x) + tv * total_variation(x)
            loss.backward()
            if signed:
                x.grad.sign_()      # the adversarial-attack trick of the paper
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(lo, hi)
            losses.append(loss.item())
        with torch.no_grad():   # restarts are scored by the matching loss alone, as the official code does
            final = float(match(x))
        if best is None or final < best[1]:
            best = (x.detach().clone(), final, losses)
    return best


def inverting_gradients(model: nn.Module, target: dict, input_shape, batch_size: int = 1,
                        labels: torch.Tensor | None = None, iterations: int = 4800, lr: float = 0.1,
                        tv: float = 1e-4, signed: bool = True, box=(0.0, 1.0), restarts: int = 1,
                        seed: int = 0) -> Reconstruction:
    """Inverting Gradients: cosine gradient distance + tv·TV(x'), signed Adam, step schedule, box constraint.
    `labels=None` infers them with `infer_labels` (exact for B = 1)."""
    _check_target(model, target, input_shape, batch_size)
    params = parameters_of(model)
    target = {k: v.detach() for k, v in target.items()}
    labels = infer_labels(model, target, batch_size) if labels is None else _check_labels(labels, batch_size)
    labels = labels.to(_device_of(target))

    def match(x):
        return cosine_distance(client_gradient(model, _flat_input(x, input_shape), labels, params), target)

    x, loss, losses = _ig_optimise(match, input_shape, batch_size, iterations, lr, tv, signed, box, restarts, seed,
                                     _device_of(target))
    return Reconstruction(x, labels, loss, losses)


def reconstruct_from_update(model: nn.Module, target_update: dict, input_shape, batch_size: int,
                            labels: torch.Tensor, local_steps: int, local_lr: float, local_batch: int | None = None,
                            iterations: int = 4800, lr: float = 0.1, tv: float = 1e-4, signed: bool = True,
                            box=(0.0, 1.0), restarts: int = 1, seed: int = 0) -> Reconstruction:
    """IG on a FedAvg upload θ_E − θ_0: the attacker knows the local schedule (steps, lr, local batch) and
    the labels, unrolls the client's SGD on x' and matches the update by cosine distance (+ TV)."""
    _check_target(model, target_update, input_shape, batch_size)
    _check_steps(local_steps, local_lr)
    labels = _check_labels(labels, batch_size).to(_device_of(target_update))
    params = parameters_of(model)
    target_update = {k: v.detach() for k, v in target_update.items()}

    def match(x):
        trial = client_update(model, _flat_input(x, input_shape), labels, local_steps, local_lr, local_batch, params)
        return cosine_distance(trial, target_update)

    x, loss, losses = _ig_optimise(match, input_shape, batch_size, iterations, lr, tv, signed, box, restarts, seed,
                                     _device_of(target_update))
    return Reconstruction(x, labels, loss, losses)


def _check_labels(labels, batch_size):
    labels = torch.as_tensor(labels)
    if labels.shape != (int(batch_size),):
        raise ValueError(f"labels must be class indices of shape ({batch_size},), got shape {tuple(labels.shape)}")
    return labels.long()


# --- recovery quality ------------------------------------------------------------------------------------
def _as_images(x, name):
    x = torch.as_tensor(x).detach().float().cpu()
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise ValueError(f"{name} must be images [B, C, H, W] or [B, H, W], got shape {tuple(x.shape)}")
    return x.numpy()


def psnr(image, reference, data_range: float = 1.0) -> float:
    """PSNR (dB) of one image against its original (scikit-image; both clipped to [0, data_range])."""
    a, r = np.clip(np.asarray(image, float), 0, data_range), np.clip(np.asarray(reference, float), 0, data_range)
    if a.shape != r.shape:
        raise ValueError(f"image and reference shapes differ: {a.shape} vs {r.shape}")
    return float(peak_signal_noise_ratio(r, a, data_range=data_range))


def ssim(image, reference, data_range: float = 1.0) -> float:
    """SSIM of one grey image [H, W] or [1, H, W] (scikit-image, 7×7 window; needs H, W >= 7)."""
    a, r = (np.clip(np.asarray(v, float), 0, data_range).squeeze() for v in (image, reference))
    if a.shape != r.shape or a.ndim != 2:
        raise ValueError(f"ssim needs two grey images of the same [H, W] shape, got {a.shape} and {r.shape}")
    return float(structural_similarity(r, a, data_range=data_range))


def match_images(recovered, originals) -> np.ndarray:
    """perm such that recovered[perm[i]] is matched to originals[i]: the Hungarian assignment minimising the
    total MSE (after clipping to [0, 1]), since a batch gradient does not reveal the order."""
    rec, ref = np.clip(_as_images(recovered, "recovered"), 0, 1), np.clip(_as_images(originals, "originals"), 0, 1)
    if rec.shape[1:] != ref.shape[1:] or rec.shape[0] < ref.shape[0]:
        raise ValueError(f"need at least as many recovered images as originals, of the same shape; got "
                         f"{rec.shape} and {ref.shape}")
    cost = ((ref[:, None] - rec[None]) ** 2).reshape(ref.shape[0], rec.shape[0], -1).mean(-1)
    rows, cols = linear_sum_assignment(cost)
    return cols[np.argsort(rows)]


def recovery_scores(recovered, originals) -> dict:
    """Mean PSNR and SSIM over the originals, each matched to its recovered image (Hungarian), plus the
    per-image values and the permutation."""
    rec, ref = _as_images(recovered, "recovered"), _as_images(originals, "originals")
    perm = match_images(rec, ref)
    p = [psnr(rec[j], ref[i]) for i, j in enumerate(perm)]
    s = [ssim(rec[j], ref[i]) for i, j in enumerate(perm)]
    return {"psnr": float(np.mean(p)), "ssim": float(np.mean(s)), "psnr_each": p, "ssim_each": s, "perm": perm}


# --- the module entry ----------------------------------------------------------------------------------
@register("gradient_inversion", claims="gradient_inversion", kind="module")
def gradient_inversion(model: nn.Module, x: torch.Tensor, y: torch.Tensor, input_shape, attack: str = "ig",
                       labels: str = "infer", seed: int = 0, **attack_kwargs) -> dict:
    """One attack end to end: the client computes its gradient on (x, y), the attacker inverts it with
    `attack` = "dlg" | "ig", and the recovery is scored against the true images. `labels` = "infer" (iDLG /
    the sign rule for IG, DLG's soft labels for DLG) or "known". Returns the Reconstruction and the scores."""
    if attack not in ("dlg", "ig"):
        raise ValueError(f"attack must be 'dlg' or 'ig', got {attack!r}")
    if labels not in ("infer", "known"):
        raise ValueError(f"labels must be 'infer' or 'known', got {labels!r}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y hold different batch sizes: {x.shape[0]} vs {y.shape[0]}")
    target = client_gradient(model, x, y)
    known = y if labels == "known" else None
    run = dlg if attack == "dlg" else inverting_gradients
    rec = run(model, target, input_shape, x.shape[0], labels=known, seed=seed, **attack_kwargs)
    scores = recovery_scores(rec.images, x.reshape(x.shape[0], *input_shape))
    return {"reconstruction": rec, **scores}
