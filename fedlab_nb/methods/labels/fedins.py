"""FedIns — Feng, Yu, Liu, Xu, Khan, Zuo, "Towards Instance-adaptive Inference for Federated Learning",
ICCV 2023 (https://arxiv.org/abs/2308.06051). Official code: https://github.com/chunmeifeng/FedIns

A frozen pre-trained backbone is tuned only through SSF (scale and shift of deep features; Lian et al.,
"Scaling & Shifting Your Features", NeurIPS 2022): h ↦ γ ⊙ h + β after chosen operations. FedIns keeps a
*pool* of P SSF entries (γ_p, β_p) at every SSF site, P classifier heads and P learnable keys k_p. For an
instance x the query q(x) is the frozen backbone's feature (the official code: the [CLS] token of the
pre-trained ViT without SSF); the top-k keys by cosine similarity select k entries, whose average is the
instance's SSF and head:

    S(x) = top-k_p cos(q(x), k_p),    γ(x) = (1/k) Σ_{p∈S(x)} γ_p,   β(x), head(x) likewise,
    loss = CE(f(x; γ(x), β(x), head(x)), y) + λ (1 − Σ_{p∈S(x)} cos(q(x), k_p))      (key–query matching)

Each client trains the pools and keys; the server averages every pool entry and every key with weights 1/K
(`public_utils.communication`: uniform client weights, all entries whose names hold "ssf_s", "Key" or
"fc_*_pool"), so only pools, heads and keys travel.

Checked against the official code (`models/vision_transformer.py`, `utils/public_utils.py`): SSF after the
linear operation and before the activation (`Mlp`: fc1 → SSF → GELU), γ ~ N(1, 0.02²), β ~ N(0, 0.02²),
keys ~ N(0, 0.02²) (timm's `trunc_normal_` cuts at ±2 in absolute value, 100 σ: no cut in effect); the
query is the [CLS] token after the final LayerNorm — here the last hidden features, layer-normalised
(`query_norm`; raw ReLU features all lie in one orthant and collapse the pool); the key loss weight w = 0.1 as (1 − w)·CE + w·(1 − Σ cos), which is
(1 − w)·[CE + λ(1 − Σ cos)] with λ = w / (1 − w) = 1/9: our λ-form, with a step size (1 − w) times the
code's. The code trains with one instance per step (so "the batch mean of the instances' SSF" in
`get_top_ssf` is one instance's SSF); here every row of a mini-batch gets its own SSF, which is the same
per-instance rule, vectorised.

Here the backbone is the project's MLP (e.g. 784-256-128-10) "pre-trained" in the notebook on a disjoint
split (`fedlab_nb.merging.fit`); `SSFPoolMLP` wraps it with SSF after every hidden Linear. Its weights are
constants of the module (not buffers as in `fedlab_nb.lora`: the engine's extra-loss and vmap kernels need a
model without buffers), so θ and every message hold exactly the pools, heads and keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core.groups import ParamGroups
from ...core.method import LocalObjective, Method, ServerSGD, UniformWeighting, weighted_mean
from ...core.registry import register
from ...data import domains
from ...models import MLP, param_spec, unflatten

OFFICIAL_KEY_WEIGHT = 0.1                       # `training_loss_weight` of the official scripts
KEY_LAMBDA = OFFICIAL_KEY_WEIGHT / (1 - OFFICIAL_KEY_WEIGHT)


def ssf(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """SSF: γ ⊙ h + β (per feature; γ, β broadcast over the batch or given per row)."""
    return h * scale + shift


def select_entries(query: torch.Tensor, keys: torch.Tensor, top_k: int):
    """(weights [B, P], cos [B, P]): cos(q, k_p) for every key and the averaging weights of the top-k keys
    (1/k on the k most similar keys, 0 elsewhere). The selection is a 0/1 mask, so it is vmappable."""
    cos = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T
    top = cos.topk(top_k, dim=-1).indices
    chosen = (top[..., None] == torch.arange(keys.shape[0], device=keys.device)).any(-2)
    return chosen.to(cos.dtype) / top_k, cos


class SSFPoolMLP(nn.Module):
    """A frozen MLP backbone with a pool of `pool_size` SSF entries after every hidden Linear (before its
    ReLU), `pool_size` classifier heads and `pool_size` keys; each instance uses the average of its
    `top_k` entries (selected by the cosine of the frozen backbone's last hidden features with the keys).

    Parameters (θ, in this order): `ssf_scale{l}`, `ssf_shift{l}` [P, width_l] per hidden layer l,
    `head_weight` [P, C, width_L], `head_bias` [P, C] and `keys` [P, width_L]. The backbone's weights are
    constants of the module (copied, never trained or sent). The heads start from the backbone's own head (ours is pre-trained on the same
    classes; the official code draws new heads for its new label set). `init_std`: spread of the SSF and
    key initialisation (the code's 0.02; 0 gives γ = 1, β = 0 exactly). Draws come from `seed`.
    `query_norm`: layer-normalise the query (the analogue of the ViT's final LayerNorm before [CLS])."""

    def __init__(self, backbone: MLP, pool_size: int = 8, top_k: int = 2, init_std: float = 0.02, seed: int = 0,
                 query_norm: bool = True):
        super().__init__()
        linears = [m for m in getattr(backbone, "body", ()) if isinstance(m, nn.Linear)]
        if not isinstance(backbone, MLP) or len(linears) < 2:
            raise ValueError("backbone must be a fedlab_nb.models.MLP with at least one hidden layer, "
                             f"got {type(backbone).__name__}; build it with make_model('mlp', ..., hidden=(256, 128))")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be an int >= 1, got {pool_size!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= pool_size:
            raise ValueError(f"top_k must be an int in 1 … pool_size = {pool_size}, got {top_k!r}")
        if not init_std >= 0:
            raise ValueError(f"init_std must be >= 0, got {init_std!r}")
        self.pool_size, self.top_k, self.n_hidden = pool_size, top_k, len(linears) - 1
        self.query_norm = bool(query_norm)
        g = torch.Generator().manual_seed(int(seed))
        # the backbone is a constant of the module (neither parameter nor buffer): θ, messages and downlink
        # bytes hold exactly the pools, heads and keys, and the vmap / extra-loss kernels apply
        self._frozen = [(lin.weight.detach().clone(), lin.bias.detach().clone()) for lin in linears]
        for i, lin in enumerate(linears[:-1]):
            width = lin.out_features
            self.register_parameter(f"ssf_scale{i}", nn.Parameter(1 + init_std * torch.randn(pool_size, width, generator=g)))
            self.register_parameter(f"ssf_shift{i}", nn.Parameter(init_std * torch.randn(pool_size, width, generator=g)))
        head = linears[-1]
        self.head_weight = nn.Parameter(head.weight.detach().clone().repeat(pool_size, 1, 1))
        self.head_bias = nn.Parameter(head.bias.detach().clone().repeat(pool_size, 1))
        self.keys = nn.Parameter(init_std * torch.randn(pool_size, head.in_features, generator=g))

    def frozen(self, i: int):
        """(W_i, b_i) of the backbone's i-th Linear (constants: no gradient is ever computed for them)."""
        return self._frozen[i]

    def _apply(self, fn, *args, **kwargs):  # `.to(device)` / `.double()` move the constant backbone too
        self._frozen = [(fn(w), fn(b)) for w, b in self._frozen]
        return super()._apply(fn, *args, **kwargs)

    def backbone_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen pre-trained MLP's own outputs (no SSF, its own head)."""
        h = F.relu(F.linear(x, *self.frozen(0)))
        for i in range(1, self.n_hidden):
            h = F.relu(F.linear(h, *self.frozen(i)))
        return F.linear(h, *self._frozen[-1])

    def query(self, x: torch.Tensor, z0: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen backbone's last hidden features (no SSF): the instance's query. `z0`: the first
        Linear's output on x if already computed."""
        h = F.relu(F.linear(x, *self.frozen(0)) if z0 is None else z0)
        for i in range(1, self.n_hidden):
            h = F.relu(F.linear(h, *self.frozen(i)))
        return F.layer_norm(h, h.shape[-1:]) if self.query_norm else h

    def selection(self, x: torch.Tensor, keys: torch.Tensor | None = None):
        """(weights [B, P], cos [B, P]) of each instance's top-k entries (`select_entries`)."""
        return select_entries(self.query(x), self.keys if keys is None else keys, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.linear(x, *self.frozen(0))       # the first pre-activation is shared by the query and the SSF path
        weights, _ = select_entries(self.query(x, z), self.keys, self.top_k)
        for i in range(self.n_hidden):
            z = z if i == 0 else F.linear(h, *self.frozen(i))
            h = F.relu(ssf(z, weights @ getattr(self, f"ssf_scale{i}"), weights @ getattr(self, f"ssf_shift{i}")))
        w_head = torch.einsum("bp,pcd->bcd", weights, self.head_weight)   # mean of the selected heads
        return torch.einsum("bcd,bd->bc", w_head, h) + weights @ self.head_bias

    def matching_loss(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Per-row 1 − Σ_{p ∈ S(x)} cos(q(x), k_p) (the official `1 − reduced_sim`); its gradient reaches
        only the keys (the query is frozen, the selection is discrete)."""
        weights, cos = select_entries(self.query(x), keys, self.top_k)
        return 1 - self.top_k * (weights * cos).sum(-1)


def routing(model: SSFPoolMLP, theta: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    """[n, k] indices of the entries each row selects under flat parameters θ, most similar key first."""
    keys = unflatten(theta, param_spec(model))["keys"]
    with torch.no_grad():
        cos = F.normalize(model.query(x), dim=-1) @ F.normalize(keys, dim=-1).T
    return cos.topk(model.top_k, dim=-1).indices.cpu().numpy()


def usage(selected: np.ndarray, pool_size: int) -> np.ndarray:
    """[P] share of the selections that went to each entry (rows of `routing`)."""
    counts = np.bincount(np.asarray(selected).ravel(), minlength=pool_size)
    return counts / counts.sum()


def effective_entries(shares: np.ndarray) -> float:
    """exp(entropy) of the usage shares: P when every entry is used equally, 1 under total collapse."""
    p = np.asarray(shares, dtype=float)
    p = p[p > 0]
    return float(math.exp(-(p * np.log(p)).sum()))


@dataclass
class KeyMatchingObjective(LocalObjective):
    """Cross-entropy plus λ · the key–query matching loss per row (`SSFPoolMLP.matching_loss`)."""
    key_weight: float = KEY_LAMBDA

    def __post_init__(self):
        if not self.key_weight >= 0:
            raise ValueError(f"key_weight (λ) must be >= 0, got {self.key_weight!r}")

    def extra_loss(self, model, params, x, y, anchor, ctx):
        if not isinstance(model, SSFPoolMLP):
            raise ValueError(f"FedIns trains an SSFPoolMLP (wrap the backbone with SSFPoolMLP), got {type(model).__name__}")
        return self.key_weight * model.matching_loss(x, params["keys"])


@register("fedins", claims="fedins", kind="method")
def fedins(key_weight: float = KEY_LAMBDA, server_lr: float = 1.0) -> Method:
    """FedIns on an `SSFPoolMLP`: clients train the SSF pools, heads and keys (CE + λ · key matching); the
    server averages every entry and key with uniform client weights (the official `communication`)."""
    return Method("fedins", KeyMatchingObjective(float(key_weight)), UniformWeighting(), weighted_mean,
                  ServerSGD(lr=server_lr))


def federated_ssf(server_lr: float = 1.0) -> Method:
    """Baseline: one federated SSF (use `SSFPoolMLP(..., pool_size=1, top_k=1)`), keys frozen and never sent."""
    return Method("fed_ssf", LocalObjective(), UniformWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=ParamGroups(frozen=("keys",)))


def head_only(server_lr: float = 1.0) -> Method:
    """Baseline: FedAvg of the classifier head on the frozen features (use `SSFPoolMLP(..., pool_size=1,
    top_k=1, init_std=0)`, whose γ = 1, β = 0 stay frozen)."""
    return Method("head_only", LocalObjective(), UniformWeighting(), weighted_mean, ServerSGD(lr=server_lr),
                  groups=ParamGroups(frozen=("ssf_*", "keys")))


def sent_floats(model: nn.Module, method: Method) -> int:
    """How many numbers one client uploads per round under `method` (the sent tensors of its groups)."""
    groups = method.groups.resolve(param_spec(model))
    return sum(math.prod(s) for n, s in groups.spec if n in groups.sent)


# --- the mixed-domain federation of the notebook -----------------------------------------------------------
DOMAINS = ("original", "rotated", "inverted", "noisy")


def apply_domain(x: torch.Tensor, domain: int, input_shape, generator: torch.Generator,
                 degrees: float = 90.0, noise_std: float = 0.3) -> torch.Tensor:
    """x in domain `domain` (an index into DOMAINS): unchanged, rotated, inverted (1 − x) or noisy."""
    if domain == 0:
        return x.clone()
    if domain == 1:
        return domains.rotate(x, input_shape, degrees)
    if domain == 2:
        return domains.invert(x)
    if domain == 3:
        return domains.add_noise(x, noise_std, generator)
    raise ValueError(f"domain must be 0 … {len(DOMAINS) - 1} ({', '.join(DOMAINS)}), got {domain!r}")


def domain_pairs(n_clients: int, n_domains: int = 4) -> list[tuple[int, int]]:
    """Client k's two domains: the n_domains-choose-2 pairs in order, cycled over the clients."""
    pairs = [(a, b) for a in range(n_domains) for b in range(a + 1, n_domains)]
    return [pairs[k % len(pairs)] for k in range(n_clients)]


def mixed_domain_clients(x: torch.Tensor, y: torch.Tensor, input_shape, n_clients: int, seed: int,
                         **domain_kw) -> tuple[list, np.ndarray]:
    """Rows (x, y) shuffled (seeded) and cut into `n_clients` equal clients; each client's rows alternate
    between its two domains (`domain_pairs`). Returns ([(x_k, y_k), ...], [n_clients, 2] domain pairs)."""
    if n_clients < 1 or len(x) < 2 * n_clients:
        raise ValueError(f"need n_clients >= 1 and at least 2 rows per client, got {n_clients} clients for {len(x)} rows")
    g = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(len(x), generator=g)
    pairs, clients = domain_pairs(n_clients), []
    for k, rows in enumerate(order.tensor_split(n_clients)):
        xk = x[rows].clone()
        for j, d in enumerate(pairs[k]):
            xk[j::2] = apply_domain(x[rows][j::2], d, input_shape, g, **domain_kw)
        clients.append((xk, y[rows]))
    return clients, np.array(pairs)


def all_domains(x: torch.Tensor, y: torch.Tensor, input_shape, seed: int, **domain_kw):
    """Every row in every domain: (x [4n, D], y [4n], domain id [4n]) — the test set of the notebook."""
    g = torch.Generator().manual_seed(int(seed))
    xs = [apply_domain(x, d, input_shape, g, **domain_kw) for d in range(len(DOMAINS))]
    return torch.cat(xs), y.repeat(len(DOMAINS)), np.repeat(np.arange(len(DOMAINS)), len(x))
