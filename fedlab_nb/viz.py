"""Seaborn figures shared by the notebooks: learning curves, label-distribution heatmaps, bars."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns


def label_heatmap(hist: np.ndarray, ax=None, title: str = ""):
    """Clients × classes label counts (rows: clients) as a heatmap."""
    ax = ax or plt.subplots(figsize=(6, max(2.5, 0.18 * len(hist) + 1)))[1]
    sns.heatmap(hist, ax=ax, cmap="viridis", cbar_kws={"label": "samples"})
    ax.set(xlabel="class", ylabel="client", title=title)
    return ax


def curves(histories: dict, metric: str = "test_acc", ax=None, title: str = ""):
    """One line per named History (or a list of Histories per name → mean ± sd band over seeds)."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    frames = []
    for name, h in histories.items():
        for seed, run in enumerate(h if isinstance(h, (list, tuple)) else [h]):
            frames.append(pd.DataFrame({"round": run["round"], metric: run[metric], "run": name, "seed": seed}))
    data = pd.concat(frames).dropna(subset=[metric])
    sns.lineplot(data=data, x="round", y=metric, hue="run", errorbar="sd", ax=ax)
    ax.set(title=title, ylabel=metric.replace("_", " "))
    ax.legend(fontsize=8)
    return ax


def bars(values: pd.DataFrame, x: str, y: str, hue: str | None = None, ax=None, title: str = ""):
    """Bar chart (mean ± sd over rows sharing x/hue)."""
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    sns.barplot(data=values, x=x, y=y, hue=hue, errorbar="sd", ax=ax)
    ax.set(title=title)
    return ax


def client_accuracy(runs: dict, ax=None, title: str = "local test accuracy per client"):
    """The distribution over clients of local-test accuracy: `runs` maps a name to a finished History
    (its `client_acc`: the global model's and, for personalised methods, each client's own model's accuracy
    on every client's test split) or to an array of per-client accuracies. Box + points, one row each."""
    rows = []
    for name, run in runs.items():
        per = getattr(run, "client_acc", None) if not isinstance(run, (np.ndarray, list)) else {"": np.asarray(run)}
        if per is None:
            raise ValueError(f"{name!r}: this History has no per-client accuracies (evaluate at least once)")
        for model, acc in per.items():
            if model != "client":
                rows += [{"run": f"{name} — {model}" if model else name, "accuracy": float(a)} for a in acc]
    data = pd.DataFrame(rows)
    ax = ax or plt.subplots(figsize=(6, 0.5 * data["run"].nunique() + 1.2))[1]
    sns.boxplot(data=data, x="accuracy", y="run", ax=ax, color="0.9", showfliers=False)
    sns.stripplot(data=data, x="accuracy", y="run", ax=ax, size=3, alpha=0.7)
    ax.set(title=title, xlabel="accuracy on the client's own test split", ylabel="")
    return ax
