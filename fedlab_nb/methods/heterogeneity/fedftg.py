"""FedFTG — Lin Zhang, Li Shen, Liang Ding, Dacheng Tao, Ling-Yu Duan, "Fine-tuning Global Model via Data-Free
Knowledge Distillation for Non-IID Federated Learning", CVPR 2022, https://arxiv.org/abs/2203.09249.
Official code: https://github.com/ZhangLin-PKU/FedFTG (`methods/local_fn_gan.py`,
`train_global_model_cgan_bs_weight_iloop_fz_dis` and `train_FedGAN_common`).

A server-side plug-in: the host method (FedAvg, FedProx, ...) aggregates as usual, then the server fine-tunes
the aggregate θ̄ by data-free distillation from the round's client models θ_k = θ + Δ_k:

* **Label histograms.** The server knows each client's label counts n_k^c (the official code reads them from the
  partition; a privacy cost: the server learns every client's label histogram).
* **Customised label sampling.** Generated labels follow the round's global counts Σ_k n_k^c: the official
  `generate_labels` allocates ⌊cumsum(p)·N⌋ labels per class for the round's N = iterations × batch draws (so the
  frequencies match p up to 1/N) and shuffles them.
* **Class-level ensemble.** α_k^c = n_k^c / Σ_j n_j^c; the teacher of a sample with label y is
  Σ_k α_k^y softmax(f_k(x̃)).
* **Generator.** A conditional generator G(z, y), z ~ N(0, I_100), persistent across rounds; a fresh Adam
  (lr 0.01) every round. Per iteration, one generator step per client k on
      α-weighted CE(f_k(G(z, y)), y)  −  hard · α-weighted mean_c |f_θ̄(x̃) − f_k(x̃)|  +  div · L_div / m,
  the middle term (hard-sample mining) pushing x̃ to where the student still disagrees with client k, and
  L_div = exp(−mean_ij ‖z_i − z_j‖²_mean · |x̃_i − x̃_j|_mean) (the official `DiversityLoss`, l1 on outputs).
  As in the official code, the CE is the batch-mean CE times the batch mean of α_k^y (`torch.mean(CE_mean · w)`).
* **Student.** Then `student_steps` (5) SGD steps (lr 0.1, fresh each round) of the global model on
  mean_{i,c}(−log softmax(f_θ̄(x̃))_ic · teacher_ic) — the official loss averages over classes too — on the same
  detached batch x̃. `iterations` (10) such iterations per round. The next round's clients start from the result.

Simplifications of ours, named: an MLP generator (z ⊕ one-hot → 256 → BatchNorm → LeakyReLU(0.2) → d → sigmoid,
for inputs in [0, 1]) instead of the official conv generator (whose output is a BatchNorm-normalised tanh); its
BatchNorm always uses batch statistics (no running statistics). No learning-rate decay (the official runs use
decay 1 too). The rule works only with hosts whose server step is θ ← θ + Σ p_k Δ_k (server lr 1, no momentum).

With `iterations = 0` the rule returns exactly θ + host_rule(Δ, w) and the server assigns it; since the host
computes θ + 1.0·agg, FedFTG with no distillation equals its host bit for bit."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from ...core.method import Method, RoundInfo, ServerAssign, ServerSGD, weighted_mean
from ...core.registry import register
from ...core.streams import register_stream
from ...models import flatten_params, param_spec, unflatten
from ..basics.fedavg import fedavg
from .fedprox import fedprox

FEDFTG_STREAM = register_stream("fedftg", 63)   # the server's generator init, z and label draws


# --- the three bookkeeping pieces (reusable, tested) -------------------------------------------------------
def label_histograms(fed, num_classes: int | None = None) -> torch.Tensor:
    """[K, C] label counts n_k^c of every client's training rows (what FedFTG's server is told)."""
    C = int(num_classes if num_classes is not None else fed.num_classes)
    rows = [torch.bincount(torch.as_tensor(y).long().cpu(), minlength=C)[:C] for _, y in fed.client_train]
    return torch.stack(rows).to(torch.float64)


def _check_counts(counts) -> torch.Tensor:
    counts = torch.as_tensor(counts, dtype=torch.float64)
    if counts.dim() != 2 or counts.shape[0] < 1 or (counts < 0).any() or not torch.isfinite(counts).all():
        raise ValueError("counts must be a [m, C] table of non-negative label counts (label_histograms(fed)), "
                         f"got shape {tuple(counts.shape)}")
    return counts


def class_ensemble_weights(counts) -> torch.Tensor:
    """[C, m] α_k^c = n_k^c / Σ_j n_j^c: each class's share of the m clients; a class nobody holds gets 1/m
    (it is never sampled). Every row sums to one."""
    counts = _check_counts(counts)
    total = counts.sum(0)
    alpha = counts / total.clamp_min(1.0)
    alpha[:, total == 0] = 1.0 / counts.shape[0]
    return (alpha / alpha.sum(0)).T.contiguous()


def sample_labels(class_counts, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """n labels with class c's share ⌊cumsum(p)·n⌋ differences, p = class_counts / Σ class_counts, shuffled
    (the official `generate_labels`: frequencies match p to within 1/n)."""
    p = torch.as_tensor(class_counts, dtype=torch.float64)
    if p.dim() != 1 or (p < 0).any() or p.sum() <= 0:
        raise ValueError("class_counts must be a 1-d tensor of non-negative counts with a positive sum")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    edges = torch.floor(torch.cumsum(p / p.sum(), 0) * n).long()
    edges[-1] = n                                  # the last class takes the remainder, as np.split does
    per_class = torch.diff(edges, prepend=torch.zeros(1, dtype=torch.long))
    labels = torch.repeat_interleave(torch.arange(len(p)), per_class)
    return labels[torch.randperm(n, generator=generator)]


def diversity_loss(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """exp(−mean_ij d_z(i, j)·d_x(i, j)) with d_z the mean squared and d_x the mean absolute difference of rows
    (the official `DiversityLoss(metric='l1')`): small when different noises give different samples."""
    z, x = z.flatten(1), x.flatten(1)
    dz = torch.cdist(z, z, p=2).pow(2) / z.shape[1]          # pairwise distances without a [B, B, D] tensor
    dx = torch.cdist(x, x, p=1) / x.shape[1]
    return torch.exp(-(dz * dx).mean())


# --- the generator -----------------------------------------------------------------------------------------
class ConditionalGenerator(nn.Module):
    """G(z, y): [z ‖ one-hot(y)] → hidden → BatchNorm (batch statistics) → LeakyReLU(0.2) → d → sigmoid, reshaped
    to `input_shape` (an MLP stand-in for the official conv `CGeneratorA`)."""

    def __init__(self, input_shape, num_classes: int, z_dim: int = 100, hidden: int = 256):
        super().__init__()
        self.input_shape, self.num_classes, self.z_dim = tuple(input_shape), int(num_classes), int(z_dim)
        self.body = nn.Sequential(nn.Linear(z_dim + num_classes, hidden),
                                  nn.BatchNorm1d(hidden, track_running_stats=False), nn.LeakyReLU(0.2),
                                  nn.Linear(hidden, int(np.prod(input_shape))), nn.Sigmoid())

    def forward(self, z, y_onehot):
        return self.body(torch.cat([z.flatten(1), y_onehot], 1)).view(-1, *self.input_shape)


# --- the server step ---------------------------------------------------------------------------------------
def _positive_int(name, value, zero_ok=False):
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= (0 if zero_ok else 1)):
        raise ValueError(f"{name} must be an integer >= {0 if zero_ok else 1}, got {value!r}")


@dataclass(eq=False)
class FedFTGRule:
    """The host's aggregation, then FedFTG's data-free fine-tuning of θ̄ = θ + host_rule(Δ, w); returns the new
    global model (use with `ServerAssign`). State: the persistent generator's flat parameters."""
    model: nn.Module | None = None
    counts: torch.Tensor | None = None        # [K, C] label histograms of all clients
    input_shape: tuple | None = None          # the shape of one data row as the model reads it (generator output)
    host_rule: object = weighted_mean
    iterations: int = 10
    generator_steps: int = 1                  # rounds of per-client generator steps per iteration (official 1)
    student_steps: int = 5
    batch_size: int = 64
    z_dim: int = 100
    hidden: int = 256
    gen_lr: float = 0.01
    student_lr: float = 0.1
    hard_weight: float = 1.0                  # 0: no hard-sample term (ablation)
    diversity_weight: float = 1.0
    label_sampling: str = "global"            # "global" (Σ_k n_k^c) | "uniform" (ablation)
    ensemble: str = "class"                   # "class" (α_k^c) | "uniform" (1/m, ablation)
    uses_context = True

    def __post_init__(self):
        if not isinstance(self.model, nn.Module):
            raise ValueError("model must be the nn.Module whose flat parameters θ the run trains (pass the same module to simulate)")
        if next(self.model.buffers(), None) is not None:
            raise ValueError("FedFTG supports models without buffers (no BatchNorm): use 'logreg', 'mlp' or 'cnn'")
        self.counts = _check_counts(self.counts)
        if not (isinstance(self.input_shape, (tuple, list)) and len(self.input_shape) >= 1):
            raise ValueError(f"input_shape must be the data's input shape, e.g. fed.input_shape, got {self.input_shape!r}")
        self.input_shape = tuple(int(v) for v in self.input_shape)
        if callable(getattr(self.host_rule, "aggregate", None)) or not callable(self.host_rule):
            raise ValueError("host_rule must be a plain rule function (updates, weights) -> [d], e.g. weighted_mean")
        _positive_int("iterations", self.iterations, zero_ok=True)   # 0: the host, bit for bit
        for name in ("generator_steps", "student_steps", "batch_size", "z_dim", "hidden"):
            _positive_int(name, getattr(self, name))
        if not (self.gen_lr > 0 and self.student_lr > 0):
            raise ValueError(f"gen_lr and student_lr must be > 0 (official 0.01 and 0.1), got {self.gen_lr}, {self.student_lr}")
        if self.label_sampling not in ("global", "uniform"):
            raise ValueError(f"label_sampling must be 'global' or 'uniform', got {self.label_sampling!r}")
        if self.ensemble not in ("class", "uniform"):
            raise ValueError(f"ensemble must be 'class' or 'uniform', got {self.ensemble!r}")
        self.spec = param_spec(self.model)
        self.num_classes = self.counts.shape[1]
        self.net = None                            # the generator module (built on first use)

    def init_state(self, theta: torch.Tensor, num_clients: int) -> dict:
        if self.counts.shape[0] != num_clients:
            raise ValueError(f"counts has {self.counts.shape[0]} rows but the federation has {num_clients} clients")
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        return {"generator": torch.zeros(0),        # initialised in round 0 from the keyed server stream
                "teacher_acc": nan}                 # last iteration: ensemble argmax == conditioning label

    def _generator(self, input_shape):
        if self.net is None:
            self.net = ConditionalGenerator(input_shape, self.num_classes, self.z_dim, self.hidden)
        return self.net

    def _initial_generator(self, net, g: torch.Generator) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**62, (1,), generator=g)))
            fresh = ConditionalGenerator(net.input_shape, net.num_classes, net.z_dim, self.hidden)
        return flatten_params(fresh).detach()

    def aggregate(self, state: dict, updates: torch.Tensor, weights, info: RoundInfo):
        if info.theta is None:
            raise ValueError("FedFTGRule needs the broadcast θ in RoundInfo (info.theta)")
        theta = info.theta.to(updates.dtype)
        averaged = theta + self.host_rule(updates, weights)
        if self.iterations == 0:
            return averaged, state
        counts = self.counts[torch.as_tensor(np.asarray(info.client_ids), dtype=torch.long)]
        new_theta, gen, fidelity = self.distill(averaged, theta + updates, counts, state["generator"],
                                                info.generator(FEDFTG_STREAM))
        return new_theta, {"generator": gen, "teacher_acc": torch.tensor(fidelity, dtype=torch.float64)}

    def metrics(self, state: dict) -> dict:
        """History column `ftg_teacher_acc`: how often the ensemble labels the round's last generated batch
        with its conditioning label (a sanity check of the generator, not a paper number)."""
        return {"ftg_teacher_acc": float(state["teacher_acc"])}

    def distill(self, student, teachers, counts, gen_params, g: torch.Generator):
        """Fine-tune the flat student θ̄ [d] from the teachers' flat models [m, d] with label counts [m, C]:
        returns (θ_ft, the generator's new flat parameters, the ensemble's accuracy on the last generated batch)."""
        net = self._generator(self.input_shape)
        gspec = param_spec(net)
        if gen_params.numel() == 0:
            gen_params = self._initial_generator(net, g)
        m, C, B = teachers.shape[0], self.num_classes, self.batch_size
        alpha = (class_ensemble_weights(counts) if self.ensemble == "class"
                 else torch.full((C, m), 1.0 / m, dtype=torch.float64)).to(student.dtype)
        label_counts = counts.sum(0) if self.label_sampling == "global" else torch.ones(C, dtype=torch.float64)
        labels_all = sample_labels(label_counts, self.iterations * B, g)
        gp = gen_params.clone().to(student.dtype).requires_grad_(True)
        w = student.detach().clone().requires_grad_(True)
        opt_g = torch.optim.Adam([gp], lr=self.gen_lr)
        opt_s = torch.optim.SGD([w], lr=self.student_lr)
        teachers = teachers.detach()
        forward = lambda flat, x: functional_call(self.model, unflatten(flat, self.spec), (x,))
        make = lambda flat, z, onehot: functional_call(net, unflatten(flat, gspec), (z, onehot))
        for e in range(self.iterations):
            y = labels_all[e * B:(e + 1) * B]
            onehot = F.one_hot(y, C).to(student.dtype)
            z = torch.randn(B, self.z_dim, generator=g).to(student.dtype)
            a = alpha[y]                                          # [B, m] per-sample client weights
            for _ in range(self.generator_steps):
                for k in range(m):                                # one generator step per client
                    opt_g.zero_grad()
                    fake = make(gp, z, onehot)
                    self.generator_loss(fake, z, y, a[:, k], forward(teachers[k], fake), forward(w.detach(), fake), m).backward()
                    opt_g.step()
            fake = make(gp.detach(), z, onehot).detach()
            target = self.ensemble_target(teachers, fake, a, forward)
            for _ in range(self.student_steps):
                opt_s.zero_grad()
                (-F.log_softmax(forward(w, fake), 1) * target).mean().backward()
                opt_s.step()
        fidelity = float((target.argmax(1) == y).double().mean())
        return w.detach(), gp.detach(), fidelity

    def generator_loss(self, fake, z, y, a_k, t_logit, s_logit, m):
        """Client k's generator loss: CE fidelity − hard-sample gap + diversity / m (official weighting)."""
        hard = -(torch.abs(s_logit - t_logit.detach()).mean(1) * a_k).mean()
        fidelity = (F.cross_entropy(t_logit, y) * a_k).mean()
        return fidelity + self.hard_weight * hard + self.diversity_weight * diversity_loss(z, fake) / m

    @staticmethod
    def ensemble_target(teachers, x, a, forward) -> torch.Tensor:
        """Σ_k a[:, k] softmax(f_k(x)): the class-level ensemble's soft labels [B, C]."""
        probs = vmap(lambda flat: F.softmax(forward(flat, x), 1))(teachers)   # [m, B, C]
        return torch.einsum("bm,mbc->bc", a, probs).detach()


def _plain_host(host) -> Method:
    if isinstance(host, str):
        makers = {"fedavg": fedavg, "fedprox": fedprox}
        if host not in makers:
            raise ValueError(f"host must be 'fedavg', 'fedprox' or a Method, got {host!r}")
        host = makers[host]()
    if not isinstance(host, Method):
        raise ValueError(f"host must be 'fedavg', 'fedprox' or a Method, got {type(host).__name__}")
    opt = host.server_opt
    if not (type(opt) is ServerSGD and opt.lr == 1.0 and not opt.momentum):
        raise ValueError("FedFTG fine-tunes θ + Σ p_k Δ_k: the host's server optimiser must be ServerSGD(lr=1, momentum=0)")
    return host


@register("fedftg", claims="fedftg", kind="method")
def fedftg(host="fedavg", *, model: nn.Module, fed=None, counts=None, **options) -> Method:
    """The host method (`"fedavg"`, `"fedprox"` or a Method with a plain rule and server lr 1) with FedFTG's
    server fine-tuning after each aggregation. `model`: the run's architecture (pass the same module to
    `simulate`); `fed`: the federation (its label histograms and input shape; or give `counts` [K, C] and
    `options["input_shape"]`). `options`: FedFTGRule's fields (iterations, student_steps, batch_size, gen_lr,
    student_lr, hard_weight, diversity_weight, label_sampling, ensemble ...)."""
    host = _plain_host(host)
    input_shape = options.pop("input_shape", None)
    if fed is not None:
        counts = label_histograms(fed) if counts is None else counts
        input_shape = tuple(fed.x_test.shape[1:]) if input_shape is None else input_shape   # one data row, as the model reads it
    if counts is None or input_shape is None:
        raise ValueError("give fed=<FederatedDataset> (or both counts=[K, C] and input_shape=...)")
    rule = FedFTGRule(model=model, counts=counts, input_shape=input_shape, host_rule=host.rule, **options)
    return dataclasses.replace(host, name=f"{host.name}+ftg", rule=rule, server_opt=ServerAssign())
