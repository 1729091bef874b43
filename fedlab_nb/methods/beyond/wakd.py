"""WAKD: weight-averaged knowledge distillation under domain shift, with SWAD and SMA as the
validation-based averaging baselines.

Paper: Valeriy Berezovskiy, Nikita Morozov, "Weight Averaging Improves Knowledge Distillation under Domain
Shift", ICCV 2023 OOD-CV workshop, https://arxiv.org/abs/2309.11446; official code
https://github.com/vorobeevich/distillation-in-dg (`src/trainer/distill_trainer.py`, `src/trainer/trainer.py`).

- KD loss (as in the official `DistillTrainer`): T² · KL(softmax(z_teacher/T) ‖ softmax(z_student/T)), batch
  mean, no hard-label term; T = 5 in the official configs.
- WAKD: from iteration `avg_start` on, the student's weights are averaged uniformly at every step (a running
  mean, no validation data); the averaged weights are the final model.
- SWAD (Cha et al., "SWAD: Domain Generalization by Seeking Flat Minima", NeurIPS 2021,
  https://arxiv.org/abs/2102.08604, code https://github.com/khanrc/swad): the averaging window [t_s, t_e] is
  chosen from the validation loss of the iterate at each checkpoint (Algorithm 1 of the paper; official config
  n_converge 3, n_tolerance 6, tolerance_ratio 0.3, i.e. threshold 1.3 × the mean loss at convergence).
- SMA (Arpit et al., "Ensemble of Averages", NeurIPS 2022, https://arxiv.org/abs/2110.10832): the same running
  mean as WAKD, but the checkpoint of it with the best validation accuracy is kept (the official repository's
  "eoa" model, which starts it at the same iteration as WAKD).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ...core.registry import register
from ...models import flatten_params, param_spec, unflatten


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 5.0) -> torch.Tensor:
    """T² · KL(p_teacher^T ‖ p_student^T), averaged over the batch (Hinton et al. 2015; the T² keeps the
    gradient scale independent of T)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p_student = F.log_softmax(student_logits / temperature, dim=-1)
    p_teacher = F.softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(log_p_student, p_teacher, reduction="batchmean") * temperature ** 2


class RunningMean:
    """Uniform running mean of parameter vectors: θ̄ ← θ̄ + (θ − θ̄)/(n + 1), O(d) memory."""

    def __init__(self):
        self.mean, self.n = None, 0

    def update(self, theta: torch.Tensor) -> None:
        theta = theta.detach()
        self.n += 1
        self.mean = theta.clone() if self.mean is None else self.mean + (theta - self.mean) / self.n


def swad_window(val_losses, n_converge: int = 3, n_tolerance: int = 6,
                tolerance_ratio: float = 0.3) -> tuple[int, int] | None:
    """SWAD's averaging window over checkpoints 0..m−1 (Cha et al. 2021, Algorithm 1) from the validation
    loss at each checkpoint; None when the loss never converges (then SWAD keeps the last model).

    Start t_s: the first checkpoint whose loss is the minimum of itself and the next n_converge − 1 ones; the
    threshold is (1 + tolerance_ratio) × the mean of those n_converge losses. End t_e: at the first checkpoint
    i after t_s where all of the last n_tolerance losses exceed the threshold, t_e = i − n_tolerance;
    if that never happens, the last checkpoint."""
    losses = np.asarray(val_losses, dtype=float)
    if n_converge < 1 or n_tolerance < 1 or not tolerance_ratio >= 0:
        raise ValueError("need n_converge >= 1, n_tolerance >= 1 and tolerance_ratio >= 0, got "
                         f"{n_converge}, {n_tolerance}, {tolerance_ratio}")
    start = next((i for i in range(len(losses) - n_converge + 1)
                  if losses[i] <= losses[i:i + n_converge].min()), None)
    if start is None:
        return None
    threshold = (1 + tolerance_ratio) * losses[start:start + n_converge].mean()
    for i in range(start + n_converge, len(losses)):
        if losses[max(0, i - n_tolerance + 1):i + 1].min() > threshold:  # never includes t_s (its loss < threshold)
            return start, i - n_tolerance
    return start, len(losses) - 1


@dataclass
class StudentRun:
    """The models one training run yields (flat vectors) and its validation curve."""
    last: torch.Tensor
    wakd: torch.Tensor
    swad: torch.Tensor
    sma: torch.Tensor
    val_losses: list = field(default_factory=list)
    val_accs: list = field(default_factory=list)
    window: tuple | None = None


def _batches(n: int, batch_size: int, iterations: int, g: torch.Generator):
    """`iterations` mini-batch index tensors, reshuffling after every pass over the n rows."""
    done = 0
    while done < iterations:
        for idx in torch.randperm(n, generator=g).split(batch_size):
            if len(idx) < batch_size or done == iterations:
                continue
            done += 1
            yield idx


@register("wakd", claims="wakd", kind="module")
def train_student(model: torch.nn.Module, theta: torch.Tensor | None, x: torch.Tensor, targets: torch.Tensor, *,
                  val: tuple, iterations: int = 3000, avg_start: int = 300, eval_every: int = 100,
                  lr: float = 1e-3, batch_size: int = 64, temperature: float = 5.0, seed: int = 0,
                  n_converge: int = 3, n_tolerance: int = 6, tolerance_ratio: float = 0.3) -> StudentRun:
    """Train a student with Adam at a constant learning rate and return its last iterate, the WAKD average,
    the SWAD average and the SMA choice.

    `targets`: teacher logits [n, C] (knowledge distillation) or labels [n] (plain training). `val` = (x_val,
    y_val, teacher logits or None): source-domain validation rows; their loss is the training loss (KD when
    distilling, as in the official code) and SMA selects on their accuracy. WAKD never looks at them."""
    distill = targets.ndim == 2
    if len(x) != len(targets):
        raise ValueError(f"x and targets must have the same number of rows, got {len(x)} and {len(targets)}")
    if not 1 <= avg_start <= iterations or eval_every < 1:
        raise ValueError(f"need 1 <= avg_start <= iterations and eval_every >= 1, got {avg_start}, {iterations}, "
                         f"{eval_every}")
    spec = param_spec(model)
    logits = lambda w, xb: functional_call(model, unflatten(w, spec), (xb,))  # noqa: E731
    loss_of = ((lambda z, t: kd_loss(z, t, temperature)) if distill else F.cross_entropy)
    x_val, y_val, t_val = val
    w = (flatten_params(model) if theta is None else theta).detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=lr)
    wakd, segment, segments = RunningMean(), RunningMean(), []
    sma, sma_acc, val_losses, val_accs = None, -1.0, [], []
    g = torch.Generator().manual_seed(int(seed))
    for it, idx in enumerate(_batches(len(x), batch_size, iterations, g), start=1):
        opt.zero_grad()
        loss_of(logits(w, x[idx]), targets[idx]).backward()
        opt.step()
        segment.update(w)  # SWAD averages every iterate of the chosen checkpoint segments
        if it >= avg_start:
            wakd.update(w)
        if it % eval_every == 0:
            with torch.no_grad():
                z = logits(w, x_val)
                val_losses.append(float(loss_of(z, t_val if distill else y_val)))
                val_accs.append(float((z.argmax(1) == y_val).double().mean()))
                if wakd.n:  # SMA: keep the running mean with the best source-validation accuracy so far
                    acc = float((logits(wakd.mean, x_val).argmax(1) == y_val).double().mean())
                    if acc > sma_acc:
                        sma, sma_acc = wakd.mean.clone(), acc
            segments.append(segment.mean)
            segment = RunningMean()
    window = swad_window(val_losses, n_converge, n_tolerance, tolerance_ratio)
    swad = segments[-1] if window is None else torch.stack(segments[window[0]:window[1] + 1]).mean(0)
    return StudentRun(w.detach(), wakd.mean, swad, wakd.mean if sma is None else sma, val_losses, val_accs, window)
