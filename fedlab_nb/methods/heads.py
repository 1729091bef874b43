"""Body / head splits for the personal-head methods (FedPer, LG-FedAvg, FedRep, FedBABU): parameter
groups whose patterns may say `HEAD` or `BODY`, resolved against the model's parameter spec at run time.

`head=None` is the model's last layer — the tensors of its last parameterised module: `body.4.*` of `mlp`
with two hidden layers, `head.3.*` of `cnn`, `head.*` of `mlp_bn` / `cnn_bn`, all of `logreg` (whose
body is then empty). `head=["body.2.*", "body.4.*"]` (glob patterns) names it explicitly."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

from ..core.groups import ParamGroups

HEAD, BODY = "<head>", "<body>"


def as_patterns(head) -> tuple | None:
    """None, one glob pattern or a sequence of them, as a tuple (hashable: part of the run's fingerprint)."""
    if head is None:
        return None
    return (head,) if isinstance(head, str) else tuple(head)


def last_layer(spec) -> tuple:
    """Names of the last parameterised module's tensors (`body.4.weight`, `body.4.bias`)."""
    prefix = spec[-1][0].rpartition(".")[0]
    return tuple(n for n, _ in spec if n.rpartition(".")[0] == prefix)


def head_names(spec, head: tuple | None = None) -> tuple:
    """The head's parameter names: those matching `head`'s patterns, or the last layer when None."""
    if head is None:
        return last_layer(spec)
    names = [n for n, _ in spec]
    for p in head:
        if not any(fnmatch(n, p) for n in names):
            raise ValueError(f"head pattern {p!r} matches no parameter; the model has {', '.join(names)}")
    return tuple(n for n in names if any(fnmatch(n, p) for p in head))


@dataclass(frozen=True)
class HeadSplit(ParamGroups):
    """ParamGroups whose `local` / `frozen` entries may be `HEAD` or `BODY` (everything but the head)."""
    head: tuple | None = None

    def resolve(self, spec):
        heads = head_names(spec, self.head)
        body = tuple(n for n, _ in spec if n not in heads)

        def expand(patterns):
            return tuple(x for p in patterns for x in (heads if p == HEAD else body if p == BODY else (p,)))
        return ParamGroups(expand(self.local), expand(self.frozen)).resolve(spec)
