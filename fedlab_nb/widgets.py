"""Interactive explorers (ipywidgets): move a control, watch the learning curve change.

    from fedlab_nb.widgets import explore
    explore(method="fedprox", dataset="digits", partition="dirichlet", alpha=0.1)

Every redraw calls the pure function `run_explorer_config(**values) -> History`, so the experiment
behind the widget is testable (and scriptable) without a browser. Sizes are small on purpose: digits
with logistic regression and ~15 rounds redraws in about a second on a laptop CPU.
"""
from __future__ import annotations

import html
from functools import lru_cache

import ipywidgets as w
import matplotlib.pyplot as plt
from IPython.display import display
from matplotlib.ticker import FuncFormatter

from .data import federate, load_dataset
from .engine import History, simulate
from .core.method import ChecksSampler, declares
from .methods import METHODS, get_method

DATASETS = ("digits", "mnist5k", "mnist1d", "wine", "breast_cancer", "synthetic")
PARTITIONS = ("iid", "dirichlet", "shards", "pathological", "quantity_skew", "natural")
MODELS = ("logreg", "mlp")

# registry methods the explorer does not offer, and why: each needs an input the explorer's controls do not give
NOT_OFFERED = {
    "fed_pub": "a graph federation (FED-PUB's own configuration)",
    "fedbn": "a model with batch-norm layers", "fedsa_lora": "a model with LoRA factors",
    "pfedpara": "a FedPara-factorised model", "fedins": "an SSF-pooled backbone",
    "fedce": "a model and a validation set", "fedftg": "a model for its generator", "fedka": "a target domain",
    "fedlaw": "a proxy set", "fedld": "a model", "inco": "a network of stages", "ldawa": "a model",
    "prowd": "a model and bit widths", "feddisco": "the federation's label histograms",
    "fedgp": "a target client sampled every round", "fedlabel": "unlabelled client data",
    "fedloge": "a representation layer (mlp or cnn)", "fedproto": "a representation layer (mlp or cnn)",
    "fedrod": "a representation layer (mlp or cnn)", "moon": "a representation layer (mlp or cnn)",
}
EXPLORABLE = tuple(m for m in METHODS if m not in NOT_OFFERED)

DEFAULTS = dict(method="fedavg", dataset="digits", partition="dirichlet", alpha=0.3, k=2, clients=20,
                clients_per_round=10, local_epochs=1, rounds=15, seed=0, model="logreg", lr=0.1, mu=0.1)


@lru_cache(maxsize=8)
def _dataset(name: str, synthetic_clients: int):
    """Load once per session (mnist5k's csv takes a moment); Synthetic(1, 1) is generated with enough clients."""
    if name == "synthetic":
        return load_dataset("synthetic", alpha=1.0, beta=1.0, num_clients=synthetic_clients)
    return load_dataset(name)


def _choice(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"{name}={value!r} is not available in the explorer; choose one of {', '.join(options)}")


def _partition_kwargs(partition: str, alpha: float, k: int) -> dict:
    """What the one 'α' slider and the one 'k' slider mean for each partitioner."""
    return {"iid": {}, "natural": {},
            "dirichlet": {"alpha": alpha, "min_size": 5},  # small clients allowed: the α slider goes to 0.01
            "quantity_skew": {"kind": "dirichlet", "alpha": alpha},
            "shards": {"shards_per_client": k},
            "pathological": {"classes_per_client": k}}[partition]


def check_config(method: str, dataset: str, partition: str, alpha: float, k: int, clients: int,
                 clients_per_round: int, local_epochs: int, rounds: int, seed: int, model: str = "logreg",
                 lr: float = 0.1, mu: float = 0.1, device: str = "cpu") -> None:
    """Raise ValueError naming the setting and the fix when the explorer's values cannot run."""
    if method in NOT_OFFERED:
        raise ValueError(f"method={method!r} needs {NOT_OFFERED[method]}, which the explorer does not set up; run it "
                         f"from its own notebook, or choose one of {', '.join(EXPLORABLE)}")
    _choice("method", method, EXPLORABLE)
    _choice("dataset", dataset, DATASETS)
    _choice("partition", partition, PARTITIONS)
    _choice("model", model, MODELS)
    for name, value in [("clients", clients), ("clients_per_round", clients_per_round),
                        ("local_epochs", local_epochs), ("rounds", rounds), ("k", k), ("seed", seed)]:
        lowest = 0 if name == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
    if clients_per_round > clients:
        raise ValueError(f"clients_per_round={clients_per_round} exceeds clients={clients}; "
                         "lower clients_per_round or raise clients")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (small = skewed, e.g. 0.1; large = near IID), got {alpha}")
    if partition == "natural" and dataset != "synthetic":
        raise ValueError("partition='natural' needs client groups: use dataset='synthetic' "
                         "(or pick another partition)")
    if not lr > 0 or mu < 0:
        raise ValueError(f"lr must be > 0 and mu >= 0, got lr={lr}, mu={mu}")


def run_explorer_config(method: str = "fedavg", dataset: str = "digits", partition: str = "dirichlet",
                        alpha: float = 0.3, k: int = 2, clients: int = 20, clients_per_round: int = 10,
                        local_epochs: int = 1, rounds: int = 15, seed: int = 0, model: str = "logreg",
                        lr: float = 0.1, mu: float = 0.1, device: str = "cpu") -> History:
    """One small experiment from the explorer's values; returns its History (the widget plots it).

    `alpha`: Dirichlet concentration (dirichlet, quantity_skew); `k`: shards or classes per client
    (shards, pathological); `mu`: FedProx's proximal weight (ignored by other methods)."""
    check_config(method, dataset, partition, alpha, k, clients, clients_per_round, local_epochs, rounds,
                 seed, model, lr, mu, device)
    ds = _dataset(dataset, max(30, clients) if dataset == "synthetic" else 0)
    fed = federate(ds, partition, n_clients=clients, seed=seed, device=device,
                   **_partition_kwargs(partition, alpha, k))
    algo = get_method(method, mu=mu) if method == "fedprox" else get_method(method)
    if declares(algo.rule, ChecksSampler):  # DP-FedAvg: its accountant must assume the explorer's m of K a round
        algo = get_method(method, sampling_rate=clients_per_round / clients, sampling="fixed")
    return simulate(algo, fed, model=model, rounds=rounds, clients_per_round=clients_per_round,
                    local_epochs=local_epochs, lr=lr, seed=seed, progress=False,
                    model_kwargs={"hidden": (64, 32)} if model == "mlp" else None)


def _label(values: dict) -> str:
    part = values["partition"]
    knob = {"dirichlet": f" α={values['alpha']:.2g}", "quantity_skew": f" α={values['alpha']:.2g}",
            "shards": f" k={values['k']}", "pathological": f" k={values['k']}"}.get(part, "")
    return f"{values['method']} · {values['dataset']} · {part}{knob} · seed {values['seed']}"


COMPARED = ("clients", "clients_per_round", "local_epochs", "rounds", "model", "lr", "mu")  # knobs not in _label


def run_labels(values: list[dict]) -> list[str]:
    """Legend labels for kept runs: `_label` plus every other knob whose value differs between the runs, so two
    runs never read the same."""
    differ = [k for k in COMPARED if len({repr(v.get(k)) for v in values}) > 1]
    return [_label(v) + "".join(f" · {k}={v.get(k)}" for k in differ) for v in values]


def plot_runs(runs: list[tuple]):
    """Test accuracy and training loss per round, one line per (label, History[, colour]); returns the Figure.
    A run keeps its colour while it is kept (the explorer passes the colour it got when it ran)."""
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(9, 3.2))
    for i, (label, hist, *colour) in enumerate(runs):
        latest = i == len(runs) - 1  # earlier runs stay as faint lines for comparison
        style = dict(lw=2 if latest else 1, alpha=1.0 if latest else 0.45, color=colour[0] if colour else f"C{i % 10}")
        h = hist.dropna(subset=["test_acc"])
        acc_ax.plot(h["round"], h["test_acc"], label=label, **style)
        loss_ax.plot(hist["round"], hist["train_loss"], **style)
    acc_ax.set(xlabel="round", ylabel="test accuracy", ylim=(0, 1))
    loss_ax.set(xlabel="round", ylabel="train loss", yscale="log")
    plain = FuncFormatter(lambda v, _: f"{v:.3g}")  # '2', '0.5' rather than '2×10⁰'
    loss_ax.yaxis.set_major_formatter(plain)
    loss_ax.yaxis.set_minor_formatter(plain)
    acc_ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def explore(run_now: bool = True, **initial):
    """An ipywidgets box: controls for method, data set, partition (α / k), clients, clients per round,
    local epochs, rounds and seed; changing one (or pressing "run") re-runs the experiment and redraws
    the curves in place. `initial` overrides `DEFAULTS`; the box's `.run()` triggers a run from code."""
    return Explorer(run_now=run_now, **initial)


class Explorer(w.VBox):
    """The explorer box. `.controls` (name -> widget), `.history` / `.figure` of the latest run,
    `.runs` (kept for comparison when "keep previous runs" is ticked), `.error` (last bad input)."""

    def __init__(self, run_now: bool = True, **initial):
        unknown = set(initial) - set(DEFAULTS) - {"device"}
        if unknown:
            raise ValueError(f"explore() got unknown settings {sorted(unknown)}; valid: {', '.join(DEFAULTS)}")
        v = {"device": "cpu", **DEFAULTS, **initial}
        check_config(**v)  # bad initial values raise here, before any widget clamps them
        self.device = v.pop("device")
        top = {name: max(limit, v[name]) for name, limit in
               [("clients", 100), ("clients_per_round", 100), ("local_epochs", 10), ("rounds", 100), ("k", 10)]}
        slider = dict(continuous_update=False, style={"description_width": "120px"})
        self.controls = {
            "method": w.Dropdown(options=list(EXPLORABLE), value=v["method"], description="method", **_no_cu(slider)),
            "dataset": w.Dropdown(options=DATASETS, value=v["dataset"], description="dataset", **_no_cu(slider)),
            "partition": w.Dropdown(options=PARTITIONS, value=v["partition"], description="partition", **_no_cu(slider)),
            "alpha": w.FloatLogSlider(value=v["alpha"], base=10, min=-2, max=3, step=0.1, description="α (Dirichlet)", **slider),
            "k": w.IntSlider(value=v["k"], min=1, max=top["k"], description="k (shards/classes)", **slider),
            "clients": w.IntSlider(value=v["clients"], min=1, max=top["clients"], description="clients", **slider),
            "clients_per_round": w.IntSlider(value=v["clients_per_round"], min=1, max=top["clients_per_round"], description="clients / round", **slider),
            "local_epochs": w.IntSlider(value=v["local_epochs"], min=1, max=top["local_epochs"], description="local epochs", **slider),
            "rounds": w.IntSlider(value=v["rounds"], min=1, max=top["rounds"], description="rounds", **slider),
            "seed": w.BoundedIntText(value=v["seed"], min=0, max=10**6, description="seed", **_no_cu(slider)),
        }
        self.fixed = {key: v[key] for key in ("model", "lr", "mu")}  # not on the panel; set via explore(...)
        self.keep = w.Checkbox(value=False, description="keep previous runs")
        self.auto = w.Checkbox(value=True, description="re-run on change")
        self.button = w.Button(description="run", button_style="primary", icon="play")
        self.status = w.HTML()
        self.output = w.Output()
        self.history, self.figure, self.error, self.runs = None, None, None, []
        self._count = 0  # runs so far: a run's colour is fixed when it runs
        self.button.on_click(lambda _: self.run())
        self.controls["clients_per_round"].max = self.controls["clients"].value
        self.controls["clients"].observe(self._limit_per_round, names="value")
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        names = list(self.controls)
        left = w.VBox([self.controls[n] for n in names[:5]])
        right = w.VBox([self.controls[n] for n in names[5:]])
        bar = w.HBox([self.button, self.auto, self.keep, self.status])
        super().__init__([w.HBox([left, right]), bar, self.output])
        if run_now:
            self.run()

    def _limit_per_round(self, change):
        """The clients-per-round slider never goes past the number of clients."""
        per_round = self.controls["clients_per_round"]
        if per_round.value > change["new"]:
            per_round.value = change["new"]
        per_round.max = change["new"]

    def values(self) -> dict:
        return {**{name: c.value for name, c in self.controls.items()}, **self.fixed, "device": self.device}

    def _changed(self, change):
        if self.auto.value:
            self.run()

    def run(self) -> History | None:
        """Re-run with the current control values and redraw; a bad combination shows its message."""
        values = self.values()
        self.status.value = "<i>running…</i>"
        try:
            hist = run_explorer_config(**values)
        except Exception as e:  # say so in the widget, keep the old plot: never a silent "running…"
            self.error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            self.status.value = f"<span style='color:#b00'>{html.escape(self.error)}</span>"
            return None
        self.error = None
        self.history = hist
        self._count += 1
        self.runs = (self.runs if self.keep.value else [])[-5:] + [(values, hist, f"C{(self._count - 1) % 10}")]
        labels = run_labels([v for v, _, _ in self.runs])
        fig = plot_runs([(label, h, c) for label, (_, h, c) in zip(labels, self.runs)])
        with self.output:
            self.output.clear_output(wait=True)
            display(fig)
        plt.close(fig)  # shown through the Output widget only, not a second time inline
        self.figure = fig
        self.status.value = (f"final test acc <b>{hist.final('test_acc'):.3f}</b> "
                             f"({hist.meta['seconds']:.1f} s)")
        return hist


def _no_cu(kw: dict) -> dict:
    return {k: val for k, val in kw.items() if k != "continuous_update"}
