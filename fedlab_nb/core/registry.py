"""The method registry: each method file registers itself, so adding a method edits no shared file.

    @register("fedprox", claims="baselines")
    def fedprox(mu=0.01): ...

The registry's one job is factories by key. `claims` names the paper a method belongs to; its claims file
papers/<claims>.yaml and its notebook notebooks/<claims>.ipynb share that name (tests/test_names.py), so the
paper ↔ notebook ↔ library index is built from the claims files, not kept here.
`kind="method"` entries are factories of round-based `Method`s (usable by name in `simulate`);
`kind="module"` entries are analyses or one-shot procedures (AFL's closed form) that still own a claims file."""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Callable

from .method import Method


@dataclass(frozen=True)
class Entry:
    key: str
    factory: Callable
    module: str          # the library file, e.g. "fedlab_nb.methods.heterogeneity.fedprox"
    claims: str | None   # the paper: papers/<claims>.yaml and notebooks/<claims>.ipynb
    kind: str            # "method" | "module"

    @property
    def notebook(self) -> str | None:
        """notebooks/<notebook>.ipynb: named after the paper id, like its claims file."""
        return self.claims


REGISTRY: dict[str, Entry] = {}


def register(key: str, *, claims: str | None = None, kind: str = "method"):
    """Decorator: register a method factory (or a module's entry function) under `key`."""
    if kind not in ("method", "module"):
        raise ValueError(f"register(kind=...) must be 'method' or 'module', got {kind!r}")

    def wrap(factory: Callable) -> Callable:
        module = inspect.getmodule(factory).__name__
        old = REGISTRY.get(key)
        if old is not None and old.module != module:
            raise ValueError(f"method key {key!r} is registered twice: by {old.module} and by {module}")
        REGISTRY[key] = Entry(key, factory, module, claims, kind)
        return factory
    return wrap


def lookup(key: str) -> Entry:
    if key not in REGISTRY:
        methods = [k for k, e in REGISTRY.items() if e.kind == "method"]
        close = difflib.get_close_matches(key, methods, n=1)
        raise ValueError(f"unknown method {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                         + f"; available: {', '.join(sorted(methods))}")
    return REGISTRY[key]


def get_method(name: str | Method, **kwargs) -> Method:
    """A `Method` by registered name (kwargs go to its factory); a `Method` passes through unchanged. Every
    method is registered once `fedlab_nb.methods` is imported (it imports every chapter), as it is whenever a
    method file runs."""
    if isinstance(name, Method):
        return name
    if not isinstance(name, str):
        raise TypeError(f"method must be a name or a Method, got {type(name).__name__}")
    entry = lookup(name)
    if entry.kind != "method":
        raise ValueError(f"{name!r} is registered as a module ({entry.module}), not a round-based method: call "
                         f"{entry.module}.{entry.factory.__name__} directly")
    return entry.factory(**kwargs)
