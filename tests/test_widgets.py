"""The interactive explorer: the pure runner, and the widget driven from code (no browser)."""
import matplotlib.pyplot as plt
import pytest

from fedlab_nb.engine import History
from fedlab_nb.widgets import DEFAULTS, check_config, explore, plot_runs, run_explorer_config

SMALL = dict(dataset="digits", clients=6, clients_per_round=3, rounds=2)


def test_run_explorer_config_returns_a_history():
    hist = run_explorer_config(**SMALL, partition="dirichlet", alpha=0.5)
    assert isinstance(hist, History)
    assert list(hist["round"]) == [1, 2]
    assert hist.meta["method"] == "fedavg" and hist.meta["clients"] == 6
    assert 0.0 <= hist.final("test_acc") <= 1.0


@pytest.mark.parametrize("partition,knob", [("iid", {}), ("shards", {"k": 2}), ("pathological", {"k": 3}),
                                            ("quantity_skew", {"alpha": 1.0})])
def test_each_partition_control_maps_to_its_partitioner(partition, knob):
    hist = run_explorer_config(**SMALL, partition=partition, **knob)
    assert hist.meta["partition"].startswith(partition)


def test_synthetic_natural_and_fedprox_mu():
    hist = run_explorer_config(method="fedprox", mu=0.5, dataset="synthetic", partition="natural",
                               clients=5, clients_per_round=2, rounds=1)
    assert hist.meta["dataset"].startswith("synthetic") and hist.meta["clients"] == 5


def test_same_values_same_history():
    a, b = run_explorer_config(**SMALL, seed=3), run_explorer_config(**SMALL, seed=3)
    assert a["test_acc"].tolist() == b["test_acc"].tolist()


@pytest.mark.parametrize("bad,fragment", [
    ({"method": "fedsgd"}, "method='fedsgd'"),
    ({"dataset": "imagenet"}, "dataset='imagenet'"),
    ({"partition": "random"}, "partition='random'"),
    ({"model": "resnet"}, "model='resnet'"),
    ({"clients_per_round": 10, "clients": 5}, "clients_per_round=10 exceeds clients=5"),
    ({"rounds": 0}, "rounds must be an integer >= 1"),
    ({"local_epochs": 1.5}, "local_epochs must be an integer"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"alpha": 0.0}, "alpha must be > 0"),
    ({"partition": "natural", "dataset": "digits"}, "needs client groups"),
    ({"lr": 0.0}, "lr must be > 0"),
])
def test_bad_values_raise_clearly(bad, fragment):
    values = {**DEFAULTS, **bad}
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_config(**values)
    with pytest.raises(ValueError, match="must|exceeds|not available|needs"):
        run_explorer_config(**values)


def test_widget_builds_runs_and_redraws():
    box = explore(**SMALL)  # runs once when built
    assert {"method", "dataset", "partition", "alpha", "k", "clients", "clients_per_round", "local_epochs",
            "rounds", "seed"} <= set(box.controls)
    assert all(getattr(c, "continuous_update", False) is False for c in box.controls.values()
               if hasattr(c, "continuous_update"))
    first = box.history
    assert isinstance(first, History) and len(first) == 2
    assert box.figure is not None and len(box.figure.axes) == 2
    assert len(box.figure.axes[0].lines) == 1

    box.controls["rounds"].value = 3  # a change re-runs ("re-run on change" is on) ...
    assert box.history is not first and len(box.history) == 3
    assert box.figure.axes[0].lines[0].get_xdata().tolist() == [1, 2, 3]
    assert "final test acc" in box.status.value

    box.keep.value = True  # ... and with "keep previous runs" the old curve stays beside the new one
    box.controls["method"].value = "scaffold"
    assert box.history.meta["method"] == "scaffold"
    assert len(box.runs) == 2 and len(box.figure.axes[0].lines) == 2


def test_widget_button_and_manual_mode():
    box = explore(run_now=False, **SMALL)
    assert box.history is None and box.figure is None
    box.auto.value = False
    box.controls["seed"].value = 1  # no re-run while "re-run on change" is off
    assert box.history is None
    box.button.click()
    assert isinstance(box.history, History) and box.history.meta["seed"] == 1


def test_clients_per_round_slider_never_passes_the_clients():
    box = explore(**SMALL)
    box.controls["clients_per_round"].value = 6
    box.controls["clients"].value = 4  # the per-round slider follows: 4 at most, and the run is valid
    assert box.controls["clients_per_round"].value == 4 and box.controls["clients_per_round"].max == 4
    assert box.error is None and box.history.meta["clients"] == 4


def test_kept_runs_name_the_knob_that_changed_and_keep_their_colour():
    box = explore(**SMALL)
    box.keep.value = True
    box.controls["local_epochs"].value = 2
    labels = [t.get_text() for t in box.figure.axes[0].get_legend().get_texts()]
    assert len(set(labels)) == 2 and "local_epochs=1" in labels[0] and "local_epochs=2" in labels[1]
    first = box.figure.axes[0].lines[0].get_color()
    box.controls["rounds"].value = 3
    assert box.figure.axes[0].lines[0].get_color() == first  # the oldest run kept its colour
    assert len({line.get_color() for line in box.figure.axes[0].lines}) == 3


def test_explore_rejects_bad_initial_values():
    with pytest.raises(ValueError, match="unknown settings"):
        explore(run_now=False, colour="red")
    with pytest.raises(ValueError, match="clients_per_round=30 exceeds clients=20"):
        explore(run_now=False, clients_per_round=30)


def test_slider_ranges_stretch_to_initial_values():
    box = explore(run_now=False, dataset="digits", clients=150, clients_per_round=120, rounds=2)
    assert box.controls["clients"].value == 150 and box.controls["clients_per_round"].value == 120


def test_plot_runs_marks_latest():
    hist = run_explorer_config(**SMALL)
    fig = plot_runs([("old", hist), ("new", hist)])
    widths = [line.get_linewidth() for line in fig.axes[0].lines]
    assert widths[-1] > widths[0]
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- every method
from fedlab_nb.methods import METHODS  # noqa: E402
from fedlab_nb.widgets import EXPLORABLE, NOT_OFFERED, run_labels  # noqa: E402

SMALL = dict(rounds=2, clients=6, clients_per_round=3)


@pytest.mark.parametrize("method", EXPLORABLE)
def test_every_offered_method_runs_on_the_explorers_settings(method):
    for model in ("logreg", "mlp"):
        hist = run_explorer_config(method=method, model=model, **SMALL)
        assert len(hist) == 2 and hist["train_loss"].notna().all()


@pytest.mark.parametrize("method", sorted(NOT_OFFERED))
def test_a_method_not_offered_cannot_run_there_and_says_why(method):
    assert method in METHODS and method not in EXPLORABLE
    with pytest.raises(ValueError, match=f"method={method!r} needs"):
        run_explorer_config(method=method, **SMALL)
    from fedlab_nb.widgets import _dataset, _partition_kwargs  # the reason holds: the bare call fails too
    from fedlab_nb import federate, get_method, simulate
    fed = federate(_dataset("digits", 0), "dirichlet", n_clients=6, seed=0, **_partition_kwargs("dirichlet", 0.3, 2))
    with pytest.raises(Exception):
        simulate(get_method(method), fed, model="logreg", rounds=1, clients_per_round=3, progress=False)


def test_an_unexpected_error_shows_in_the_status_instead_of_a_hang(monkeypatch):
    import fedlab_nb.widgets as W
    ex = explore(run_now=False)
    monkeypatch.setattr(W, "run_explorer_config", lambda **v: (_ for _ in ()).throw(TypeError("boom <b>")))
    assert ex.run() is None
    assert "TypeError: boom &lt;b&gt;" in ex.status.value and "running" not in ex.status.value


def test_ticks_and_legends_read_plainly():
    fig = plot_runs([(run_labels([{**DEFAULTS, "alpha": 0.125893}])[0], run_explorer_config(**SMALL))])
    loss_ax = fig.axes[1]
    fig.canvas.draw()
    labels = [t.get_text() for t in loss_ax.get_yticklabels(which="both") if t.get_text()]
    assert labels and not any("times" in t or "×" in t or "^" in t for t in labels)
    assert "α=0.13" in fig.axes[0].get_legend().get_texts()[0].get_text()
