"""fedlab_nb.studies: the configurations × paired seeds loop of the notebooks, as data."""
import numpy as np
import pytest

from fedlab_nb import studies


def test_product_is_every_combination_last_axis_fastest():
    assert studies.product(rule=["a", "b"], lr=[1, 2]) == [
        {"rule": "a", "lr": 1}, {"rule": "a", "lr": 2}, {"rule": "b", "lr": 1}, {"rule": "b", "lr": 2}]
    for bad in ([], "ab", 3):
        with pytest.raises(ValueError, match="axis 'lr' must be a non-empty list"):
            studies.product(lr=bad)


def test_grid_runs_seed_outer_config_inner_with_one_setup_per_seed():
    calls, setups = [], []

    def setup(seed):
        setups.append(seed)
        return {"offset": 100 * seed}

    def run(seed, offset, rule, scale):
        calls.append((seed, rule, scale))
        return {"acc": offset + scale + (rule == "b")}
    frame = studies.grid(run, studies.product(rule=["a", "b"], scale=[1, 2]), [3, 4], setup=setup)
    assert setups == [3, 4] and calls[:4] == [(3, "a", 1), (3, "a", 2), (3, "b", 1), (3, "b", 2)]
    assert list(frame.columns) == ["seed", "rule", "scale", "acc"] and len(frame) == 8
    assert frame.loc[(frame.seed == 4) & (frame.rule == "b") & (frame.scale == 2), "acc"].item() == 403
    assert studies.grid(lambda seed, x: x * seed, [{"x": 2}], [5]).value.tolist() == [10]  # a bare number: "value"


def test_paired_differences_follow_the_seed_and_the_filter():
    rows = [{"seed": s, "rule": r, "m": m, "acc": s + (m * 10) + (r == "cc")} for s in (0, 1, 2)
            for r in ("median", "cc") for m in (0.0, 0.9)]
    import pandas as pd
    frame = pd.DataFrame(rows)
    gain = studies.paired(frame, "acc", by="m", a=0.9, b=0.0, where={"rule": "median"})
    assert np.allclose(gain, [9, 9, 9])
    assert studies.per_seed(frame[frame.rule == "cc"], "acc", "m").shape == (3, 2)
    with pytest.raises(ValueError):  # two rows per (seed, m) without the filter: refused, not the first kept
        studies.per_seed(frame, "acc", "m")
    with pytest.raises(ValueError, match="one row per seed with m == 0.5"):
        studies.paired(frame, "acc", by="m", a=0.5, b=0.0, where={"rule": "median"})
    with pytest.raises(ValueError, match="one row per seed"):   # two rows per seed without the filter
        studies.paired(frame, "acc", by="m", a=0.9, b=0.0)


def test_grid_refuses_bad_input_with_the_fix():
    with pytest.raises(ValueError, match="at least one configuration and one seed"):
        studies.grid(lambda seed: 1, [], [0])
    with pytest.raises(ValueError, match="seeds must be distinct"):
        studies.grid(lambda seed: 1, [{}], [0, 0])
    with pytest.raises(ValueError, match="clash with the seed"):
        studies.grid(lambda seed, fed: 1, [{"fed": 2}], [0], setup=lambda s: {"fed": 1})
