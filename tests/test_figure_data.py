"""Figure data: what save_figure stores, the reference in papers/figures/<id>.json, and the comparison
within tolerance (a perturbed curve fails). `assert_figures_match` is the helper the notebook tests use."""
from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedlab_nb import cli, repro  # noqa: E402
from fedlab_nb.repro import claims as C  # noqa: E402
from fedlab_nb.repro import figures as F  # noqa: E402
from fedlab_nb.repro import recording as R  # noqa: E402

from test_repro import make_root  # noqa: E402


def assert_figures_match(paper, run_dir) -> None:
    """Fail when a run's figure data leaves the reference's tolerance; skip when there is no reference yet."""
    problems = F.figure_problems(paper, run_dir)
    if problems is None:
        pytest.skip(f"no figure reference {F.reference_path(paper.id, paper.root)} yet; create it with "
                    f"`fedlab-nb figures update {paper.id}`")
    assert not problems, (f"{paper.id}: figure data differs from {F.reference_path(paper.id, paper.root)}; "
                          f"if the change is intended run `fedlab-nb figures update {paper.id}`:\n"
                          + "\n".join(problems))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "_metrics", {})
    monkeypatch.setenv(R.RUN_DIR_ENV, str(tmp_path / "run"))
    return tmp_path / "run"


def curve_figure(y, label="fedavg"):
    fig, ax = plt.subplots()
    ax.plot(range(len(y)), y, label=label)
    ax.bar([0, 1], [3, 5])
    return fig


def payload(y, **kw):
    fig = curve_figure(y, **kw)
    out = {"main": F.figure_payload(fig, "main")}
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------- extraction
def test_save_figure_writes_extracted_data(run_dir):
    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1, 2], [0.1, 0.5, float("nan")], label="acc")
    b.imshow(np.arange(6).reshape(2, 3))
    b.scatter([1, 2], [3, 4])
    repro.save_figure(fig)
    plt.close(fig)
    data = json.loads((run_dir / "main.data.json").read_text())
    assert data["source"] == "figure" and (run_dir / "main.png").is_file()
    series = {s["key"]: s for s in data["series"]}
    assert series["ax0/line0:acc"]["values"] == [0.1, 0.5, None] and series["ax0/line0:acc"]["x"] == [0, 1, 2]
    assert series["ax1/image0"]["shape"] == [2, 3] and series["ax1/image0"]["values"] == [0, 1, 2, 3, 4, 5]
    assert series["ax1/scatter0"]["values"] == [1, 3, 2, 4]


def test_bars_and_heatmaps_skip_colorbars():
    import seaborn as sns
    fig, (a, b) = plt.subplots(1, 2)
    a.barh([0, 1], [2.0, 7.0], label="counts")
    sns.heatmap(np.eye(2), ax=b)  # adds a colorbar axes, whose gradient is not data
    series = F.extract_figure_data(fig)
    plt.close(fig)
    assert [s["key"] for s in series] == ["ax0/bar0:counts", "ax1/mesh0"]
    assert series[0]["values"] == [2.0, 7.0] and series[1]["shape"] == [2, 2]


def test_strip_plot_jitter_is_not_data():
    import pandas as pd
    import seaborn as sns
    data = pd.DataFrame({"accuracy": [0.1, 0.2, 0.3, 0.4], "run": ["a", "a", "b", "b"]})
    found = []
    for seed in (0, 1):
        np.random.seed(seed)  # seaborn draws the jitter from numpy's global generator
        fig, ax = plt.subplots()
        sns.stripplot(data=data, x="accuracy", y="run", ax=ax)
        found.append([s["values"] for s in F.extract_figure_data(fig)])
        plt.close(fig)
    assert found[0] == found[1] and found[0][0] == [0.1, 0.0, 0.2, 0.0]


def test_save_figure_with_data_stores_seed_spread(run_dir):
    import pandas as pd
    fig = curve_figure([0.1, 0.2])
    per_seed = np.array([[0.1, 0.2, 0.3], [0.3, 0.4, 0.5]])  # 2 seeds × 3 points
    repro.save_figure(fig, name="curves", data={"fedavg": per_seed, "oracle": [1, 2, 3],
                                                "given": {"mean": [1, 2], "sd": [0.1, 0.1], "n": 5}})
    repro.save_figure(fig, name="table", data=pd.DataFrame({"round": [1, 2], "acc": [0.5, 0.6], "who": ["a", "b"]}))
    plt.close(fig)
    series = {s["key"]: s for s in json.loads((run_dir / "curves.data.json").read_text())["series"]}
    assert series["fedavg"]["values"] == pytest.approx([0.2, 0.3, 0.4])
    assert series["fedavg"]["sd"] == pytest.approx([np.sqrt(0.02)] * 3) and series["fedavg"]["n"] == 2
    assert "sd" not in series["oracle"] and series["given"]["n"] == 5
    table = json.loads((run_dir / "table.data.json").read_text())["series"]
    assert [s["key"] for s in table] == ["round", "acc"]  # non-numeric columns are left out


@pytest.mark.parametrize("data, message", [
    ([1, 2], "dict of name"), ({}, "dict of name"), ({"a": np.zeros((1, 2, 3))}, "seeds × points"),
    ({"a": ["x"]}, "numbers"), ({"a": {"sd": [1]}}, "'mean'"),
])
def test_bad_figure_data_is_refused_without_run_dir(monkeypatch, data, message):
    monkeypatch.delenv(R.RUN_DIR_ENV, raising=False)
    fig = curve_figure([0.1])
    with pytest.raises((TypeError, ValueError), match=message):
        repro.save_figure(fig, data=data)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- comparison
BASE = [0.10, 0.40, 0.60, 0.70, 0.75]


def test_same_curve_passes_and_perturbed_curve_fails():
    ref = payload(BASE)
    assert F.compare_figures(payload(BASE), ref) == []
    assert F.compare_figures(payload([v * 1.01 for v in BASE]), ref) == []  # inside rtol 2 %
    perturbed = list(BASE)
    perturbed[3] += 0.05
    problems = F.compare_figures(payload(perturbed), ref)
    assert len(problems) == 1 and "ax0/line0:fedavg: values[3] = 0.75, reference 0.7" in problems[0]


def test_structure_changes_fail():
    ref = payload(BASE)
    assert "values has 4 points, reference 5" in F.compare_figures(payload(BASE[:4]), ref)[0]
    problems = F.compare_figures(payload(BASE, label="fedprox"), ref)
    assert any("series 'ax0/line0:fedavg' missing" in p for p in problems)
    assert any("new series 'ax0/line0:fedprox'" in p for p in problems)
    assert F.compare_figures({}, ref) == ["figure 'main': in the reference, not saved by this run"]
    nan = list(BASE)
    nan[0] = float("nan")
    assert "values[0] is None, reference 0.1" in F.compare_figures(payload(nan), ref)[0]


def test_tolerance_grows_with_the_seed_spread():
    def spread(values, sd):
        return {"fig": {"series": [F._data_entry("acc", {"mean": values, "sd": [sd] * len(values), "n": 5})]}}
    moved = [v + 0.03 for v in BASE]
    assert F.compare_figures(spread(moved, 0.0), spread(BASE, 0.0))  # no spread: 0.03 is a change
    # 4 standard errors of a difference of two 5-seed means: 4 · 0.02 · √(2/5) ≈ 0.051 > 0.03
    assert F.compare_figures(spread(moved, 0.02), spread(BASE, 0.02)) == []
    assert F.point_tolerance({"sd": [0.02], "n": 5}, 0, 0.5, F.DEFAULT_TOLERANCE) == \
        pytest.approx(1e-3 + 0.02 * 0.5 + 4 * 0.02 * np.sqrt(2 / 5))


def test_claims_file_tolerance_is_used(tmp_path):
    ref, moved = payload(BASE), payload([v + 0.03 for v in BASE])
    assert F.compare_figures(moved, ref)
    assert F.compare_figures(moved, ref, {"atol": 0.05}) == []


def test_changes_lists_what_moved():
    ref = payload(BASE)
    assert F.changes(payload(BASE), ref) == ["no change"]
    assert F.changes(payload(BASE), None) == ["new reference: figure 'main' with 2 series"]
    moved = F.changes(payload([v + 1e-4 for v in BASE]), ref)
    assert len(moved) == 1 and "ax0/line0:fedavg" in moved[0]


def test_corrupt_reference_names_the_fix(tmp_path):
    (tmp_path / "papers" / "figures").mkdir(parents=True)
    (tmp_path / "papers" / "figures" / "x.json").write_text("{")
    with pytest.raises(F.FigureDataError, match="fedlab-nb figures update x"):
        F.load_reference("x", tmp_path)


# ---------------------------------------------------------------------------------------------- reference round trip
def _fake_run(folder, y):
    folder.mkdir(parents=True, exist_ok=True)
    F.write_figure_data(folder, "main", payload(y)["main"])
    return folder


def test_update_then_check_via_cli(tmp_path, capsys):
    root = make_root(tmp_path)
    run = _fake_run(tmp_path / "run", BASE)
    paper = C.load_paper("tiny", root)
    assert F.figure_problems(paper, run) is None  # no reference yet -> the notebook test skips
    assert cli.main(["figures", "update", "tiny", "--root", str(root), "--from", str(run)]) == 0
    assert "new reference: figure 'main'" in capsys.readouterr().out
    assert json.loads(F.reference_path("tiny", root).read_text())["parameters"] == {"n_points": 4}
    assert cli.main(["figures", "check", "tiny", "--root", str(root), "--from", str(run)]) == 0
    assert F.figure_problems(paper, run) == []

    perturbed = list(BASE)
    perturbed[2] = 0.9
    _fake_run(run, perturbed)
    assert cli.main(["figures", "check", "tiny", "--root", str(root), "--from", str(run)]) == 1
    assert "values[2] = 0.9, reference 0.6" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="figures update tiny"):
        assert_figures_match(paper, run)
    assert cli.main(["figures", "update", "tiny", "--root", str(root), "--from", str(run)]) == 0
    assert "values[2] = 0.9, reference 0.6" in capsys.readouterr().out  # says what changed
    assert_figures_match(paper, run)


def _run_on(folder, y, cpu):
    """A fake run whose figure data says it was made on CPU kind `cpu`."""
    folder.mkdir(parents=True, exist_ok=True)
    F.write_figure_data(folder, "main", {**payload(y)["main"], "cpu": cpu})
    return folder


def test_figure_data_records_the_cpu_kind():
    import torch
    assert payload(BASE)["main"]["cpu"] == torch.backends.cpu.get_cpu_capability() == F.cpu_kind()


def test_a_run_on_another_cpu_kind_is_kept_beside_the_main_reference(tmp_path, capsys):
    """A chaotic run ends elsewhere on another summation order: its kind's run is recorded under by_cpu and each
    run is compared with its own kind's reference; the tolerance is not widened."""
    root = make_root(tmp_path)
    paper = C.load_paper("tiny", root)
    main = _run_on(tmp_path / "main", BASE, "AVX512")
    F.update_reference(paper, tmp_path / "results", main)
    moved = list(BASE)
    moved[3] = 0.2
    other = _run_on(tmp_path / "other", moved, "AVX2")
    problems = F.figure_problems(paper, other)
    assert "values[3] = 0.2, reference 0.7" in problems[0]
    assert "CPU kind AVX2; the reference was recorded on AVX512" in problems[-1]

    _, lines = F.update_reference(paper, tmp_path / "results", other)
    assert lines[0] == "CPU kind AVX2 (the main reference: AVX512):"
    stored = json.loads(F.reference_path("tiny", root).read_text())
    assert stored["cpu"] == "AVX512" and set(stored["by_cpu"]) == {"AVX2"}
    assert F.figure_problems(paper, other) == [] and F.figure_problems(paper, main) == []
    assert F.figure_problems(paper, _run_on(tmp_path / "main2", moved, "AVX512"))  # still strict on each kind
    third = F.figure_problems(paper, _run_on(tmp_path / "third", moved, "DEFAULT"))  # no run of that kind: main
    assert "values[3]" in third[0] and "recorded on AVX512" in third[-1]

    _, lines = F.update_reference(paper, tmp_path / "results", main)  # a new main reference drops the others
    assert any("dropped the AVX2 run" in line for line in lines)
    assert "by_cpu" not in json.loads(F.reference_path("tiny", root).read_text())


def test_bad_by_cpu_names_the_fix(tmp_path):
    path = tmp_path / "papers" / "figures" / "x.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"figures": {}, "by_cpu": {"AVX2": [1, 2]}}))
    with pytest.raises(F.FigureDataError, match="by_cpu.*figures update x"):
        F.load_reference("x", tmp_path)


def test_check_without_reference_or_data_is_an_error(tmp_path, capsys):
    root = make_root(tmp_path)
    assert cli.main(["figures", "check", "tiny", "--root", str(root), "--from", str(tmp_path)]) == 1
    assert "create it with `fedlab-nb figures update tiny`" in capsys.readouterr().err
    assert cli.main(["figures", "update", "tiny", "--root", str(root), "--from", str(tmp_path)]) == 1
    assert "no *.data.json files" in capsys.readouterr().err


@pytest.mark.notebook
def test_notebook_run_records_figure_data(tmp_path):
    """End to end on the fixture notebook: reproduce stores figure data; update, then a re-run matches."""
    from fedlab_nb.repro.runner import reproduce
    root, out = make_root(tmp_path), tmp_path / "results"
    result = reproduce("tiny", "smoke", root=root, out_dir=out)
    assert result["figure_data"] == ["tiny-smoke/main.data.json"]
    paper = C.load_paper("tiny", root)
    F.update_reference(paper, out)
    forced = reproduce("tiny", "smoke", root=root, out_dir=out, force=True)
    assert forced["error"] is None
    assert_figures_match(paper, out / "tiny-smoke")
    reproduce("tiny", "smoke", root=root, out_dir=out, parameters={"value": 0.7})
    assert F.figure_problems(paper, out / "tiny-smoke")  # a changed curve is caught
