"""Experiments as data: a grid of configurations run over paired seeds, one tidy row per (seed, configuration).

A notebook's experiment is usually "for every seed, build the federation; for every configuration, run and keep a
few numbers". `grid` is that loop, so the notebook keeps only the idea — what one run is and which configurations
to compare:

    configs = studies.product(rule=["median", "cc"], momentum=[0.0, 0.9])
    runs = studies.grid(one_run, configs, seeds, setup=lambda s: {"fed": fl.federate("digits", "iid", seed=s)})
    gain = studies.paired(runs, "acc", by="momentum", a=0.9, b=0.0, where={"rule": "median"})

Seeds are paired: every configuration of a seed sees the same `setup(seed)` (the same federation, the same
Byzantine clients), so a difference between two configurations is taken seed by seed — what the claims'
paired intervals judge (papers/SCHEMA.md, "Verdicts over seeds").
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from .utils import check_seeds


def product(**axes: Sequence) -> list[dict]:
    """Every combination of the axes' values, in order (the last axis varies fastest):
    product(rule=["a", "b"], lr=[0.1, 0.2]) -> [{rule: a, lr: 0.1}, {rule: a, lr: 0.2}, {rule: b, ...}, ...]."""
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not len(values):
            raise ValueError(f"axis {name!r} must be a non-empty list of values, got {values!r}; e.g. {name}=[0.1, 0.2]")
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def grid(run: Callable[..., Mapping | float], configs: Sequence[Mapping], seeds: Sequence[int], *,
         setup: Callable[[int], Mapping] | None = None) -> pd.DataFrame:
    """`run(seed=s, **setup(s), **config)` for every seed (outer loop) and configuration (inner loop), in that
    order. `run` returns a number (column "value") or a mapping of named numbers; the frame has one row per
    (seed, configuration): the seed, the configuration's keys, then the returned values."""
    for name, fn in (("run", run), ("setup", setup)):
        if fn is not None and not callable(fn):
            raise TypeError(f"grid: {name} must be a function ({name}(seed=..., ...)), got {type(fn).__name__} {fn!r:.60}")
    configs, seeds = _configs(configs), check_seeds(seeds, "grid: seeds")
    if not configs or not seeds:
        raise ValueError(f"grid needs at least one configuration and one seed, got {len(configs)} and {len(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct (paired runs), got {seeds}")
    rows = []
    for seed in seeds:
        shared = setup(seed) if setup is not None else {}
        if not isinstance(shared, Mapping):
            raise ValueError(f"grid: setup({seed}) returned {type(shared).__name__}; it must return a mapping of the "
                             "arguments every configuration of that seed shares, e.g. {'fed': federation}")
        shared = dict(shared)
        for config in configs:
            clash = set(config) & (set(shared) | {"seed"})
            if clash:
                raise ValueError(f"configuration keys {sorted(clash)} clash with the seed or setup's keys {sorted(shared)}")
            out = run(seed=seed, **shared, **config)
            values = dict(out) if isinstance(out, Mapping) else {"value": out}
            relabel = sorted(set(values) & ({"seed"} | set(config)), key=str)
            if relabel:  # the row would name another seed or configuration than the run's
                raise ValueError(f"grid: run returned {relabel}, the name of the row's seed or configuration column; "
                                 "rename those values (e.g. 'final_lr')")
            rows.append({"seed": seed, **config, **values})
    return pd.DataFrame(rows)


def _configs(configs) -> list[Mapping]:
    """A list of mappings {name: value} with names that are strings (they become run's keyword arguments)."""
    if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, Iterable):
        raise ValueError(f"grid: configs must be a list of mappings, e.g. studies.product(lr=[0.1, 0.2]), got "
                         f"{type(configs).__name__} {configs!r:.60}")
    configs = list(configs)
    bad = [c for c in configs if not isinstance(c, Mapping) or not all(isinstance(k, str) for k in c)]
    if bad:
        raise ValueError(f"grid: configs must be mappings with string keys, e.g. [{{'lr': 0.1}}], got {bad[0]!r:.60}")
    return configs


def _columns(frame: pd.DataFrame, caller: str, **names) -> None:
    """Each named column must be in the frame (pandas' own KeyError says neither which argument nor the columns)."""
    for argument, columns in names.items():
        for column in [columns] if isinstance(columns, str) or not isinstance(columns, Sequence) else columns:
            if column not in frame.columns:
                raise ValueError(f"{caller}: {argument} {column!r} is not a column of the frame; its columns: "
                                 f"{', '.join(map(str, frame.columns))}")


def per_seed(frame: pd.DataFrame, metric: str, by: str | Sequence[str]) -> pd.DataFrame:
    """One row per seed, one column per value of `by` (or per combination of several `by` columns); two rows for
    the same seed and column are refused (pandas' ValueError), never silently dropped."""
    _columns(frame, "per_seed", metric=metric, by=by)
    return frame.pivot(index="seed", columns=by, values=metric).sort_index()


def paired(frame: pd.DataFrame, metric: str, *, by: str, a, b, where: Mapping | None = None) -> np.ndarray:
    """Per-seed differences metric[by == a] − metric[by == b] (seed order), after keeping the rows matching
    `where` ({column: value}); every seed must have exactly one row on each side."""
    _columns(frame, "paired", metric=metric, by=by, where=list(where or {}))
    rows = frame
    for column, value in (where or {}).items():
        rows = rows[rows[column] == value]
    sides = []
    for value in (a, b):
        side = rows[rows[by] == value].set_index("seed")[metric]
        if side.empty or side.index.duplicated().any():
            raise ValueError(f"paired needs one row per seed with {by} == {value!r} (where {dict(where or {})}); "
                             f"found {len(side)} rows for seeds {sorted(side.index.tolist())}")
        sides.append(side)
    if set(sides[0].index) != set(sides[1].index):
        raise ValueError(f"the two sides of paired({metric!r}) cover different seeds: {sorted(sides[0].index)} vs "
                         f"{sorted(sides[1].index)}")
    seeds = sorted(sides[0].index)
    return (sides[0].loc[seeds] - sides[1].loc[seeds]).to_numpy()
