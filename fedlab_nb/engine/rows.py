"""The round's [m, d] rows matrix, reused from round to round when nothing else holds it.

Every round's local training writes one [m, d] matrix (the clients' weights or Δ rows). On the CPU, glibc
maps any block above 32 MiB afresh and unmaps it when freed, so a fresh matrix of that size page-faults on its
first write: for 100 clients of a 199,210-parameter MLP (80 MB) that costs a sixth of the round's local
training. A run's rounds need the same matrix again, so `RoundRows` keeps last round's and hands it out again
— but only when no one else can see it: no Python reference, view, autograd graph or NumPy array of it is
left (a method that keeps last round's Δ in its state gets a fresh matrix, and its copy is never written).
`stacked_views` shapes a block of rows as one [c, *shape] view per parameter tensor (batched and fused use it).
"""
from __future__ import annotations

import math
import sys

import torch

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it nothing is reused


def _holders(t: torch.Tensor) -> tuple:
    """What refers to t and its memory: Python references (views hold their base), C++ tensors (autograd's
    saved tensors), Python references to its storage, users of its storage (NumPy arrays from `.numpy()`)."""
    storage = t.untyped_storage()
    return sys.getrefcount(t), t._use_count(), sys.getrefcount(storage), _storage_use_count(storage._cdata)


def _alone() -> tuple:
    """_holders of a tensor held by one name only, seen from the depth `unheld` sees it from."""
    def probe(t):
        return _holders(t)
    t = torch.empty(1)
    return probe(t)


_ALONE = _alone() if _storage_use_count is not None else None


def unheld(t: torch.Tensor) -> bool:
    """True when the caller's one reference is all that refers to `t` and its memory."""
    return _ALONE is not None and _holders(t) == _ALONE


class RoundRows:
    """One reusable rows matrix per key (a training track) for the rounds of a run.

    `take(key, m, like)` returns an uninitialised [m, like.numel()] matrix of like's dtype and device: a view
    of the key's kept memory when it is large enough (and not more than twice the size), unheld, and on the
    same device; else fresh memory, which is then kept. The caller must write every row."""

    def __init__(self):
        self._kept: dict[str, torch.Tensor] = {}

    def take(self, key: str, m: int, like: torch.Tensor) -> torch.Tensor:
        n = m * like.numel()
        kept = self._kept.pop(key, None)
        if kept is None or kept.dtype != like.dtype or kept.device != like.device or not n <= kept.numel() <= 2 * n \
                or not unheld(kept):
            kept = like.new_empty(n)
        self._kept[key] = kept
        return kept[:n].view(m, like.numel())


def rows_out(out: torch.Tensor | None, m: int, theta: torch.Tensor) -> torch.Tensor:
    """The [m, d] matrix a backend writes its m rows into: `out` when given (checked), else a fresh one."""
    if out is None:
        return theta.new_empty(m, theta.numel())
    if out.shape != (m, theta.numel()) or out.dtype != theta.dtype or out.device != theta.device \
            or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous [{m}, {theta.numel()}] {theta.dtype} matrix on {theta.device} "
                         f"(one row per job), got {tuple(out.shape)} {out.dtype} on {out.device}; "
                         "pass out=None for a fresh one")
    return out


def stacked_views(W: torch.Tensor, spec) -> dict[str, torch.Tensor]:
    """Views of the rows of W [c, d] shaped [c, *shape] per parameter (updating one updates W)."""
    out, i = {}, 0
    for name, shape in spec:
        n = math.prod(shape)
        out[name] = W[:, i:i + n].view(W.shape[0], *shape)
        i += n
    return out
