"""FedLabel — Cho, Joshi, Dimitriadis, "Local or Global: Selective Knowledge Assimilation for Federated Learning
with Limited Labels", ICCV 2023 (https://arxiv.org/abs/2307.08809). No official code is known.

Clients hold few labels (`fedlab_nb.data.semisup`). Client k keeps a *local* model v_k (in the client store,
never sent) next to its copy w of the *global* model. At every local step, on a batch of unlabelled rows u:

    p_l = softmax f(v; α(u)),  p_g = softmax f(w; α(u))          (α: weak view; both detached)
    expert(u) = local if max p_l > max p_g else global             ("whichever is more of an expert")
    ŷ = argmax p_expert,   accepted = max p_expert ≥ τ            (FixMatch-style threshold)
    agree = argmax p_l == argmax p_g                               (identical pseudo-labels)

and each of the two models takes an SGD step on

    L(w) = CE(f(w; x_l), y_l) + λ_u · (1/|u|) Σ_u accepted · CE(f(w; A(u)), ŷ)
                              + λ_c · (1/|u|) Σ_u agree · KL(p_l ‖ softmax f(w; α(u)))

(A: strong view; for v the KL target is p_g). Only w's update Δ = w − θ is uploaded, so the message is
FedAvg's; the server averages it with the labelled-set sizes. τ > 1 accepts nothing, and with λ_c = 0 the
step on w is the supervised FedAvg step on the labelled batch, bit for bit.

Taken from the abstract: the per-sample choice of the local or global model as pseudo-labeller, the
global–local consistency term on samples with identical pseudo-labels, no extra models or communicated
parameters (only the global model goes up), the local model staying on the client. Our reading, not
verified against the paper's text (not readable offline): "more of an expert" = higher max-softmax
confidence, the threshold τ = 0.95 and FixMatch's weak/strong views, KL as the divergence, and the local
model trained with the same loss as the global copy. `selection="global"` is the global-only pseudo-labelling
baseline (FedAvg + FixMatch), "local" the local-only one. Unlabelled batches and augmentations are keyed by
(seed, stream "fedlabel" = 62, round, client).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from ...core.registry import register
from ...core.streams import register_stream
from ...data.semisup import SemiSupervisedDataset, strong_augment, weak_augment
from ...models import param_spec, unflatten
from ...utils import rng
from ...core.method import DataSizeWeighting, Method, OwnTraining, ServerSGD, weighted_mean

FEDLABEL = register_stream("fedlabel", 62)
SELECTIONS = ("select", "global", "local")


def select_pseudo_labels(p_local: torch.Tensor, p_global: torch.Tensor, tau: float, selection: str = "select"):
    """(pseudo-labels ŷ, accepted mask, from_local mask, agree mask) for class probabilities [..., n, C]:
    the expert is the model with the higher max-probability (ties go to the global model)."""
    conf_l, lab_l = p_local.max(-1)
    conf_g, lab_g = p_global.max(-1)
    if selection == "select":
        from_local = conf_l > conf_g
    else:
        from_local = torch.full_like(lab_l, selection == "local", dtype=torch.bool)
    labels = torch.where(from_local, lab_l, lab_g)
    accepted = torch.where(from_local, conf_l, conf_g) >= tau
    return labels, accepted, from_local, lab_l == lab_g


def pseudo_label_accuracy(model, v: torch.Tensor, theta: torch.Tensor, x_u: torch.Tensor, y_u: torch.Tensor,
                          tau: float = 0.95) -> dict:
    """Diagnostics of one client's unlabelled rows (clean inputs, every row labelled by argmax): accuracy of
    the local model v's, the global θ's and the selected expert's pseudo-labels, the share routed to the
    local model, and the share and accuracy of the selected labels that pass τ. `y_u` is the hidden truth."""
    spec = param_spec(model)
    with torch.no_grad():
        p_l = F.softmax(functional_call(model, unflatten(v, spec), (x_u,)), -1)
        p_g = F.softmax(functional_call(model, unflatten(theta, spec), (x_u,)), -1)
    labels, accepted, from_local, _ = select_pseudo_labels(p_l, p_g, tau)
    right = (labels == y_u).float()
    return {"local": float((p_l.argmax(1) == y_u).float().mean()), "global": float((p_g.argmax(1) == y_u).float().mean()),
            "selected": float(right.mean()), "routed_local": float(from_local.float().mean()),
            "accepted": float(accepted.float().mean()),
            "accepted_acc": float(right[accepted].mean()) if accepted.any() else float("nan")}


def _pair_loss(model, spec, loss_fn, lam_u: float, lam_c: float):
    """loss(w, x_l, y_l, l_mask, x_weak, x_strong, u_mask, labels, accepted, agree, p_other): one model's
    FedLabel loss. `l_mask` None: the rows are all real and the supervised term is `loss_fn` itself (the
    loop path, FedAvg's loss bit for bit); else padded rows are masked out of every mean (the vmap path)."""
    def logits(w, x):
        return functional_call(model, unflatten(w, spec), (x,))

    def loss(w, x_l, y_l, l_mask, x_weak, x_strong, u_mask, labels, accepted, agree, p_other):
        if l_mask is None:
            total = loss_fn(w, x_l, y_l)  # FedAvg's supervised loss, first and unchanged
        else:
            ce_l = F.cross_entropy(logits(w, x_l), y_l, reduction="none")
            total = (l_mask * ce_l).sum() / l_mask.sum().clamp_min(1)
        n_u = u_mask.sum().clamp_min(1)
        if lam_u and labels.shape[-1]:
            ce = F.cross_entropy(logits(w, x_strong), labels, reduction="none")
            total = total + lam_u * (u_mask * accepted.to(ce.dtype) * ce).sum() / n_u
        if lam_c and labels.shape[-1]:
            log_q = F.log_softmax(logits(w, x_weak), -1)
            kl = (torch.special.xlogy(p_other, p_other) - p_other * log_q).sum(-1)  # KL(p_other ‖ q)
            total = total + lam_c * (u_mask * agree.to(kl.dtype) * kl).sum() / n_u
        return total
    return loss


def _pad(rows: list, n: int) -> tuple:
    """Stack tensors of unequal length along dim 0, zero-padded to n rows, with a 0/1 row mask."""
    out = torch.zeros((len(rows), n, *rows[0].shape[1:]), dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros(len(rows), n, device=rows[0].device)
    for i, t in enumerate(rows):
        out[i, :len(t)], mask[i, :len(t)] = t, 1.0
    return out, mask


@dataclass
class FedLabelClient(OwnTraining):
    """Local training of FedLabel (module docstring). `mu`: unlabelled rows per labelled row in a step's
    batch (FixMatch's μ); `probe`: an optional dict that gets {client id: its local model v} after each round
    (for diagnostics, e.g. `pseudo_label_accuracy`), not part of the method. Backend "loop" trains client by
    client (the reference); any other backend trains the round's clients together with `torch.func.vmap`
    when their schedules have equal length (same draws, same result up to float rounding)."""
    tau: float = 0.95
    unsup_weight: float = 1.0
    consistency: float = 1.0
    mu: int = 3
    selection: str = "select"
    max_shift: int = 1
    noise_std: float = 0.1
    erase_scale: tuple = (0.1, 0.3)
    probe: dict | None = None

    @property
    def keeps_local(self) -> bool:
        """The local model is needed unless pseudo-labels come from the global model and λ_c = 0."""
        return self.selection != "global" or self.consistency > 0

    def client_state(self, method, theta, groups):
        return {"v": theta.clone()} if self.keeps_local else {}  # v_k⁰ = θ⁰

    def local_train(self, method, ctx, jobs, down, cstate):
        fed = ctx.fed
        if not isinstance(fed, SemiSupervisedDataset):
            raise ValueError("FedLabel needs unlabelled client data: pass fedlab_nb.data.semisup.semi_supervised("
                             "fed, fraction, seed) to simulate instead of a fully labelled federation")
        if not ctx.optimizer.plain:
            raise ValueError("FedLabel runs plain client SGD; build it with fedlabel(...) and no client optimizer")
        theta, lr, model = down["theta"], ctx.lr, ctx.model
        loss = _pair_loss(model, param_spec(model), ctx.loss_fn, self.unsup_weight, self.consistency)
        views = [self.unlabelled_views(fed, job, ctx.seed, ctx.round) for job in jobs]
        V0 = cstate["v"] if self.keeps_local else None
        if ctx.backend == "loop" or len({len(j.batches) for j in jobs}) > 1:
            rows = [self._client(grad_and_value(loss), model, theta, None if V0 is None else V0[i], job, vw, lr)
                    for i, (job, vw) in enumerate(zip(jobs, views))]
            W, V, losses = (None if t[0] is None else torch.stack(t) for t in zip(*rows))
        else:
            W, V, losses = self._together(loss, model, theta, V0, jobs, views, lr)
        if self.probe is not None and V is not None:
            self.probe.update({j.client_id: V[i].detach().clone() for i, j in enumerate(jobs)})
        new = {"v": V} if self.keeps_local else cstate
        return {"delta": W - theta}, new, losses

    def unlabelled_views(self, fed, job, seed: int, r: int) -> list:
        """Per local step, (weak view, strong view) of a fresh draw of mu·|batch| unlabelled rows (without
        replacement within the step), keyed by (seed, 62, round, client); the same on both backends."""
        x_u = fed.client_unlabelled[job.client_id][0]
        g = rng(seed, FEDLABEL, r, job.client_id)
        aug, shape, out = torch.Generator().manual_seed(int(g.integers(2**62))), fed.input_shape, []
        for idx in job.batches:
            rows = torch.as_tensor(g.choice(len(x_u), min(len(x_u), self.mu * len(idx)), replace=False),
                                   dtype=torch.long, device=x_u.device)
            u = x_u[rows]
            out.append((weak_augment(u, shape, aug, self.max_shift),
                        strong_augment(u, shape, aug, self.max_shift, self.noise_std, self.erase_scale)))
        return out

    def _client(self, step, model, theta, v0, job, views, lr):
        """One client's round, step by step: (w, v, mean loss of w); v is None when no local model is kept."""
        spec = param_spec(model)
        w, v, total = theta.clone(), None if v0 is None else v0.clone(), theta.new_zeros(())
        for idx, (x_weak, x_strong) in zip(job.batches, views):
            idx = torch.as_tensor(idx, device=theta.device)
            x_l, y_l = job.x[idx], job.y[idx]
            u_mask = torch.ones(len(x_weak), device=theta.device)
            with torch.no_grad():
                p_g = F.softmax(functional_call(model, unflatten(w, spec), (x_weak,)), -1)
                p_l = p_g if v is None else F.softmax(functional_call(model, unflatten(v, spec), (x_weak,)), -1)
            labels, accepted, _, agree = select_pseudo_labels(p_l, p_g, self.tau, self.selection)
            args = (x_l, y_l, None, x_weak, x_strong, u_mask, labels, accepted, agree)
            grad_w, loss = step(w, *args, p_l)
            if v is not None:
                grad_v, _ = step(v, *args, p_g)
                v = v - lr * grad_v
            w = w - lr * grad_w  # FedAvg's step when nothing is accepted and λ_c = 0
            total += loss.detach()
        return w, v, total / max(len(job.batches), 1)

    def _together(self, loss, model, theta, V0, jobs, views, lr):
        """All the round's clients at once (equal step counts): padded batches, vmapped over clients."""
        spec, m = param_spec(model), len(jobs)
        probs = vmap(lambda w, x: F.softmax(functional_call(model, unflatten(w, spec), (x,)), -1))
        step = vmap(grad_and_value(loss))
        W, V = theta.repeat(m, 1), None if V0 is None else V0.clone()
        total = theta.new_zeros(m)
        for s in range(len(jobs[0].batches)):
            idx = [torch.as_tensor(j.batches[s], device=theta.device) for j in jobs]
            x_l, l_mask = _pad([j.x[i] for j, i in zip(jobs, idx)], max(len(i) for i in idx))
            y_l, _ = _pad([j.y[i] for j, i in zip(jobs, idx)], x_l.shape[1])
            n_u = max(len(vw[s][0]) for vw in views)
            x_weak, u_mask = _pad([vw[s][0] for vw in views], n_u)
            x_strong, _ = _pad([vw[s][1] for vw in views], n_u)
            with torch.no_grad():
                p_g = probs(W, x_weak)
                p_l = p_g if V is None else probs(V, x_weak)
            labels, accepted, _, agree = select_pseudo_labels(p_l, p_g, self.tau, self.selection)
            args = (x_l, y_l, l_mask, x_weak, x_strong, u_mask, labels, accepted, agree)
            grad_w, value = step(W, *args, p_l)
            if V is not None:
                V = V - lr * step(V, *args, p_g)[0]
            W = W - lr * grad_w
            total += value.detach()
        return W, V, total / max(len(jobs[0].batches), 1)

    def personal(self, method, theta, cstate, groups):
        """The clients' local models v_k (evaluated on their own test rows), or None without them."""
        return cstate["v"] if self.keeps_local and "v" in cstate else None


def _check(name, value, low, high=None, strict_low=False):
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    bad = bad or (value <= low if strict_low else value < low) or (high is not None and value > high)
    if bad:
        bound = f"> {low}" if strict_low else f">= {low}"
        raise ValueError(f"FedLabel's {name} must be a number {bound}" + (f" and <= {high}" if high is not None else "")
                         + f", got {value!r}")


@register("fedlabel", claims="fedlabel", kind="method")
def fedlabel(tau: float = 0.95, unsup_weight: float = 1.0, consistency: float = 1.0, mu: int = 3,
             selection: str = "select", max_shift: int = 1, noise_std: float = 0.1, erase_scale=(0.1, 0.3),
             server_lr: float = 1.0, probe: dict | None = None) -> Method:
    """FedLabel. `tau`: the confidence threshold (> 1: no pseudo-label accepted); `unsup_weight`: λ_u of the
    pseudo-label loss; `consistency`: λ_c of the global–local KL (0: off); `mu`: unlabelled rows per labelled
    row; `selection`: "select" (FedLabel), "global" or "local" (single-pseudo-labeller baselines)."""
    _check("tau", tau, 0.0, strict_low=True)
    _check("unsup_weight", unsup_weight, 0.0)
    _check("consistency", consistency, 0.0)
    if selection not in SELECTIONS:
        raise ValueError(f"FedLabel's selection must be one of {SELECTIONS}, got {selection!r}")
    if isinstance(mu, bool) or not isinstance(mu, int) or mu < 1:
        raise ValueError(f"FedLabel's mu (unlabelled rows per labelled row) must be an integer >= 1, got {mu!r}")
    client = FedLabelClient(float(tau), float(unsup_weight), float(consistency), mu, selection, max_shift,
                            float(noise_std), tuple(erase_scale), probe)
    return Method("fedlabel" if selection == "select" else f"fedlabel_{selection}", weighting=DataSizeWeighting(),
                  rule=weighted_mean, server_opt=ServerSGD(lr=server_lr), client=client)
