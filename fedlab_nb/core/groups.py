"""Parameter groups: which tensors a client trains, sends, keeps local or leaves frozen.

A group is a set of parameter-tensor names chosen by glob patterns over the model's parameter spec
(`fedlab_nb.models.param_spec`), e.g. FedPer keeps the head local: `ParamGroups(local=["body.4.*"])`.
    trained = all − frozen;   sent = trained − local
Kept-local tensors are trained by the client and stored in its client state; frozen tensors never move."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch


@dataclass(frozen=True)
class ParamGroups:
    local: tuple = ()    # glob patterns of tensors trained but never sent (personal heads, BN, LoRA B ...)
    frozen: tuple = ()   # glob patterns of tensors nobody trains (a frozen backbone, supermask weights)

    def resolve(self, spec) -> "ResolvedGroups":
        names = [n for n, _ in spec]
        for kind, patterns in (("local", self.local), ("frozen", self.frozen)):
            for p in patterns:
                if not any(fnmatch(n, p) for n in names):
                    raise ValueError(f"ParamGroups({kind}=...): pattern {p!r} matches no parameter; the model has "
                                     f"{', '.join(names)}")
        frozen = {n for n in names if any(fnmatch(n, p) for p in self.frozen)}
        local = {n for n in names if n not in frozen and any(fnmatch(n, p) for p in self.local)}
        return ResolvedGroups(spec, frozenset(names) - frozen, frozenset(names) - frozen - local, frozenset(local))


@dataclass(frozen=True)
class ResolvedGroups:
    spec: list
    trained: frozenset
    sent: frozenset
    local: frozenset
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def mask(self, which: str, device=None) -> torch.Tensor:
        """A bool [d] mask over the flat vector of the tensors in group `which` ('trained', 'sent', 'local')."""
        key = (which, str(device))
        if key not in self._cache:
            names = getattr(self, which)
            parts = [torch.full((math.prod(s),), n in names, dtype=torch.bool) for n, s in self.spec]
            self._cache[key] = torch.cat(parts).to(device)
        return self._cache[key]

    def index(self, which: str, device=None) -> torch.Tensor:
        """Flat positions of group `which` (int64), the layout of its part of a message."""
        key = ("index", which, str(device))
        if key not in self._cache:
            self._cache[key] = self.mask(which).nonzero().ravel().to(device)
        return self._cache[key]

    @property
    def everything_sent(self) -> bool:
        return len(self.sent) == len(self.spec)

    def segments(self, which: str) -> list[tuple[int, int]]:
        """(start, end) of each tensor in group `which` in the flat vector (for in-place slice updates)."""
        out, i = [], 0
        for n, s in self.spec:
            k = math.prod(s)
            if n in getattr(self, which):
                out.append((i, i + k))
            i += k
        return out
