"""GGEUR — Ma, Dai, Huang, Chen, "Geometric Knowledge-Guided Localized Global Distribution Alignment for
Federated Learning", CVPR 2025, arXiv 2503.06457. Official code: https://github.com/WeiDai-David/2025CVPR_GGEUR

Clients hold embeddings of a frozen backbone (CLIP in the paper). GGEUR is a one-shot preprocessing step:

    client k, class c:  upload (n_kc, μ_kc, Σ_kc)         Σ_kc = (1/n_kc) Σ_i (x_i − μ_kc)(x_i − μ_kc)ᵀ
    server, class c:    μ_c = Σ_k n_kc μ_kc / N_c
                        Σ_c = Σ_k n_kc Σ_kc / N_c + Σ_k n_kc (μ_kc − μ_c)(μ_kc − μ_c)ᵀ / N_c
                        (the law of total covariance: exactly the covariance of the pooled embeddings)
                        geometric shape of class c = eigenpairs (λ_j, ξ_j) of Σ_c
    client k, class c:  new embeddings  x' = a + Σ_j z_j √λ_j ξ_j,  z ~ N(0, I)   (i.e. x' ~ N(a, Σ_c))
                        single domain: anchors a = the client's own samples of class c;
                        multi domain:  anchors are also the other clients' class-c prototypes μ_k'c

Each class the client holds is filled up to `target_per_class` embeddings (originals kept), then any FL
method trains a classifier head on the augmented embeddings. Checked against the official scripts
(`clip_tensor2aggregate_covariance_matrix.py`, `cov_matrix_generate_features.py`,
`prototype_cov_matrix_generate_features.py`): 1/n covariances pooled as above; negative eigenvalues set to
0; samples drawn as N(a, Σ_c); in single-domain mode anchors are own samples (distinct ones when the class
has enough, else uniformly from a pool generated around every sample); in multi-domain mode the fill comes
in equal shares from the own samples and from each other domain's prototype, and the top 10 eigenvalues
are amplified by factors 5 → 1 (`amplify_top`). A class a client lacks gets no samples in either mode (as
in the code). Simplifications here: the server pools every client holding the class (the single-domain
code can restrict it to a "client-guided" subset); shares are drawn with replacement, not subsampled
from fixed pools. Everything is float64.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ...core.registry import register
from ...core.streams import register_stream
from ...utils import rng

GGEUR = register_stream("ggeur", 48)   # the clients' generation noise and anchor choices
DTYPE = torch.float64


@dataclass
class ClassStats:
    """Per-class statistics of one client (or of the server's pool): counts [C], means [C, d], covs [C, d, d]
    (1/n covariances; rows of absent classes are zero)."""
    counts: torch.Tensor
    means: torch.Tensor
    covs: torch.Tensor


def _check_xy(x, y, num_classes):
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"embeddings x must be a 2-D [n, d] tensor, got {getattr(x, 'shape', type(x))}")
    if not isinstance(y, torch.Tensor) or y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"labels y must be a 1-D tensor with one label per row of x ({len(x)}), "
                         f"got {getattr(y, 'shape', type(y))}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, num_classes={num_classes}); got {int(y.min())} … {int(y.max())}")


def class_statistics(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> ClassStats:
    """What client k uploads: (n_kc, μ_kc, Σ_kc) for every class c, in float64."""
    _check_xy(x, y, num_classes)
    x, d = x.to(DTYPE), x.shape[1]
    counts = torch.zeros(num_classes, dtype=DTYPE)
    means, covs = torch.zeros(num_classes, d, dtype=DTYPE), torch.zeros(num_classes, d, d, dtype=DTYPE)
    for c in range(num_classes):
        xc = x[y == c]
        if len(xc):
            counts[c], means[c] = len(xc), xc.mean(0)
            centred = xc - means[c]
            covs[c] = centred.T @ centred / len(xc)
    return ClassStats(counts, means, covs)


def pool_statistics(stats: list[ClassStats]) -> ClassStats:
    """The server's law of total covariance over the clients' (n, μ, Σ): per class, the statistics of the union."""
    if not stats:
        raise ValueError("pool_statistics needs the statistics of at least one client")
    if len({tuple(s.covs.shape) for s in stats}) != 1:
        raise ValueError("clients' statistics have different shapes: every client must use the same backbone "
                         "and num_classes")
    n = torch.stack([s.counts for s in stats])                       # [K, C]
    mu = torch.stack([s.means for s in stats])                       # [K, C, d]
    total = n.sum(0)
    w = n / total.clamp(min=1)                                       # n_kc / N_c (0 for absent classes)
    mean = torch.einsum("kc,kcd->cd", w, mu)
    gap = mu - mean                                                  # μ_kc − μ_c
    within = torch.einsum("kc,kcde->cde", w, torch.stack([s.covs for s in stats]))
    between = torch.einsum("kc,kcd,kce->cde", w, gap, gap)
    return ClassStats(total, mean, within + between)


def centralised_statistics(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> ClassStats:
    """The reference the server's pool must equal: the per-class statistics of all embeddings in one place."""
    return class_statistics(x, y, num_classes)


def geometric_shape(cov: torch.Tensor, amplify_top: int = 0, amplify_max: float = 5.0):
    """Eigenvalues (descending, negatives set to 0) and eigenvectors [d, d] (columns) of one class's Σ_c.
    `amplify_top` > 0 multiplies the top eigenvalues by factors spaced linearly from `amplify_max` down to 1
    (the official multi-domain script: top 10, 5 → 1)."""
    if not isinstance(cov, torch.Tensor) or cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"cov must be a square [d, d] tensor, got {getattr(cov, 'shape', type(cov))}")
    if not torch.allclose(cov, cov.T, atol=1e-8 * max(1.0, float(cov.abs().max()))):
        raise ValueError("cov must be symmetric (a covariance matrix); symmetrise it with (cov + cov.T) / 2")
    if isinstance(amplify_top, bool) or not isinstance(amplify_top, int) or not 0 <= amplify_top <= len(cov):
        raise ValueError(f"amplify_top must be an int in [0, d={len(cov)}], got {amplify_top!r}")
    if not amplify_max >= 1:
        raise ValueError(f"amplify_max must be >= 1 (a factor on the top eigenvalues), got {amplify_max}")
    vals, vecs = torch.linalg.eigh(cov.to(DTYPE))
    vals, vecs = vals.flip(0).clamp(min=0), vecs.flip(1)             # descending; PSD as in the code
    if amplify_top:
        vals = vals.clone()
        vals[:amplify_top] *= torch.linspace(amplify_max, 1.0, amplify_top, dtype=DTYPE)
    return vals, vecs


def generate(anchors: torch.Tensor, eigvals: torch.Tensor, eigvecs: torch.Tensor,
             generator: torch.Generator) -> torch.Tensor:
    """One new embedding per anchor row: a + Σ_j z_j √λ_j ξ_j, z ~ N(0, I); so E[(x' − a)(x' − a)ᵀ] = Σ_c."""
    if anchors.ndim != 2 or anchors.shape[1] != len(eigvals) or eigvecs.shape != (len(eigvals), len(eigvals)):
        raise ValueError(f"anchors [m, d] must match the shape's d = {len(eigvals)}; got anchors "
                         f"{tuple(anchors.shape)}, eigvecs {tuple(eigvecs.shape)}")
    if (eigvals < 0).any():
        raise ValueError("eigvals must be >= 0; build them with geometric_shape (it clamps negative ones)")
    z = torch.randn(anchors.shape, generator=generator, dtype=DTYPE)
    return anchors.to(DTYPE) + (z * eigvals.sqrt()) @ eigvecs.T


def _choose_anchors(own: torch.Tensor, prototypes: torch.Tensor | None, needed: int, g: torch.Generator):
    """Single domain: distinct own samples when there are enough, else own samples uniformly at random.
    Multi domain: equal shares from the own samples and from each other client's prototype."""
    n = len(own)
    if prototypes is None or len(prototypes) == 0:
        pick = torch.randperm(n, generator=g)[:needed] if n >= needed else torch.randint(n, (needed,), generator=g)
        return own[pick]
    source = torch.randint(len(prototypes) + 1, (needed,), generator=g)     # 0: own samples, j: prototype j − 1
    own_pick = own[torch.randint(n, (needed,), generator=g)]
    return torch.where((source == 0)[:, None], own_pick, prototypes[(source - 1).clamp(min=0)])


def augment_client(x: torch.Tensor, y: torch.Tensor, shapes, target_per_class: int, generator: torch.Generator,
                   prototypes=None):
    """Client side: fill every class the client holds up to `target_per_class` embeddings (originals first).
    `shapes[c]` = (eigvals, eigvecs) of the global Σ_c; `prototypes[c]` = [P, d] other clients' class-c means
    (multi-domain mode) or None."""
    num_classes = len(shapes)
    _check_xy(x, y, num_classes)
    if isinstance(target_per_class, bool) or not isinstance(target_per_class, int) or target_per_class < 1:
        raise ValueError(f"target_per_class must be a positive integer, got {target_per_class!r}")
    xs, ys = [x.to(DTYPE)], [y]
    for c in range(num_classes):
        own = x[y == c].to(DTYPE)
        needed = target_per_class - len(own)
        if len(own) == 0 or needed <= 0:                              # absent class: nothing (as in the code)
            continue
        protos = None if prototypes is None else prototypes[c]
        anchors = _choose_anchors(own, protos, needed, generator)
        xs.append(generate(anchors, *shapes[c], generator))
        ys.append(torch.full((needed,), c, dtype=y.dtype))
    return torch.cat(xs), torch.cat(ys)


def other_prototypes(stats: list[ClassStats], k: int) -> list[torch.Tensor]:
    """Per class, the means μ_k'c of every other client k' ≠ k that holds class c: [P_c, d]."""
    others = [s for j, s in enumerate(stats) if j != k]
    d, out = stats[0].means.shape[1], []
    for c in range(len(stats[0].counts)):
        held = [s.means[c] for s in others if s.counts[c] > 0]
        out.append(torch.stack(held) if held else torch.zeros(0, d, dtype=DTYPE))
    return out


@register("ggeur", claims="ggeur", kind="module")
def ggeur(client_data, num_classes: int, target_per_class: int = 200, seed: int = 0, multi_domain: bool = False,
          amplify_top: int | None = None, amplify_max: float = 5.0):
    """The whole method on a list of clients' (embeddings, labels): statistics up, pooled shapes down,
    local generation. Returns (augmented client data, the server's pooled ClassStats). `multi_domain`: also
    generate around the other clients' class prototypes; `amplify_top` defaults to 10 there (the official
    multi-domain script) and to 0 in single-domain mode. Client k's draws use the stream (seed, GGEUR, k)."""
    client_data = list(client_data)
    if not client_data:
        raise ValueError("ggeur needs at least one client's (embeddings, labels)")
    stats = [class_statistics(x, y, num_classes) for x, y in client_data]
    pooled = pool_statistics(stats)
    top = (min(10, pooled.covs.shape[1]) if multi_domain else 0) if amplify_top is None else amplify_top
    shapes = [geometric_shape(pooled.covs[c], top, amplify_max) for c in range(num_classes)]
    out = []
    for k, (x, y) in enumerate(client_data):
        g = torch.Generator().manual_seed(int(rng(seed, GGEUR, k).integers(2**62)))
        protos = other_prototypes(stats, k) if multi_domain else None
        out.append(augment_client(x, y, shapes, target_per_class, g, protos))
    return out, pooled


def with_train_data(fed, client_train):
    """A shallow copy of a FederatedDataset whose clients train on `client_train` (e.g. GGEUR-augmented
    embeddings); their local test splits and the global test set are unchanged. Do not call `.to(...)` on
    it (that rebuilds the tensors from the original rows): build it on the device you run on."""
    if len(client_train) != fed.num_clients:
        raise ValueError(f"client_train has {len(client_train)} clients, the federation {fed.num_clients}")
    out = copy.copy(fed)
    out.client_train = [(x.to(fed.device, fed.client_test[k][0].dtype), y.to(fed.device))
                        for k, (x, y) in enumerate(client_train)]
    return out
