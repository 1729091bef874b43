"""Probe 42q: a seventeenth, independent re-run of issue 42's failure classes, aimed first at what is new since the
sixteenth (check_sampled's int64 ids, FixedPoint's max_q bound, read_result's verdict vocabulary, History's
`_numeric`, the board counting a paper once) and at the fifteenth's fixes with variants the earlier
test_probe42*.py do not try: a deterministic round-robin sampler declared as fixed, clients sampled in correlated
pairs under Poisson accounting, a fair Poisson sampler over 5,000 clients, History rows whose ε is negative or whose
δ is not a probability, numpy integer bits, Flower counts just past a partition's rows, results at several scales
of one paper, scale names with controls in the board. Each test asserts the correct behaviour; a test marked
xfail(strict=True) was an open finding; every finding of this probe is fixed and its test is a plain one."""
import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

from probes import RESULT, cli, fed10, root_copy  # noqa: F401 (fed10: a fixture)
from probes import clean, no_traceback
from probes import sampling_check_run as _check_run


# ================================================================================ (1, new code) the sampling check
def _round_robin(r, K, g):
    return np.array([r % K])


# finding 2 (fixed: sampling_tests, a count that stays within w of q·t and every client's share too even)
def test_a_round_robin_schedule_declared_fixed_is_refused():
    assert _check_run(10, 0.1, "fixed", _round_robin, 3000) is not None


def test_a_round_robin_schedule_declared_poisson_is_refused():  # held
    assert _check_run(10, 0.1, "poisson", _round_robin, 3000) is not None


def _pairs(r, K, g):  # clients 2i and 2i+1 always together, each pair at rate q: marginal rate q, not independent
    return np.flatnonzero(np.repeat(g.random(K // 2) < 0.1, 2))


# finding 3 (fixed: sampling_tests, two clients together more often than Binomial(n, p₂) allows)
def test_clients_sampled_in_pairs_are_refused_under_poisson():
    assert _check_run(10, 0.1, "poisson", _pairs, 3000) is not None


def test_a_fair_poisson_sampler_over_5000_clients_is_never_refused():  # held
    assert _check_run(5000, 0.5, "poisson", lambda r, K, g: np.flatnonzero(g.random(K) < 0.5), 400) is None


def test_a_fair_poisson_sampler_with_a_tiny_rate_is_never_refused():  # held
    assert _check_run(3, 1e-4, "poisson", lambda r, K, g: np.flatnonzero(g.random(K) < 1e-4), 3000) is None


def test_a_fixed_sampler_taking_everyone_at_q_one_is_never_refused():  # held
    assert _check_run(5, 1.0, "fixed", lambda r, K, g: np.arange(K), 300) is None


def test_a_fixed_sampler_picking_one_client_at_twice_its_share_is_refused():  # held
    pick = lambda r, K, g: np.array([0]) if g.random() < 0.2 else np.array([1 + g.integers(K - 1)])  # noqa: E731
    assert _check_run(10, 0.1, "fixed", pick, 3000) is not None


# ================================================================================ (new code) check_sampled
@pytest.mark.parametrize("ids", [np.array([3, 1], np.uint64), np.array([1, 2], np.uint16), [4, 0], (2,)],
                         ids=["uint64 unsorted", "uint16", "list", "tuple"])
def test_check_sampled_gives_int64_ids_for_any_integer_answer(ids):  # held
    from fedlab_nb.engine.sampling import check_sampled
    out = check_sampled(ids, 10, 0)
    assert out.dtype == np.int64 and sorted(out.tolist()) == sorted(int(i) for i in ids)


@pytest.mark.parametrize("ids", [np.array([1.0, 2.0]), np.array([[1, 2]]), np.array([True, False]), np.array([10])],
                         ids=["floats", "2-D", "mask", "K"])
def test_check_sampled_refuses_answers_that_are_not_client_ids(ids):  # held
    from fedlab_nb.engine.sampling import check_sampled
    with pytest.raises(ValueError, match="round 1"):
        check_sampled(ids, 10, 0)


# ================================================================================ (new code) FixedPoint
@pytest.mark.parametrize("kw", [dict(clip=np.float32(1.0), scale=2.0 ** 31 - 0.5, bits=32),
                                dict(clip=2.0, scale=2.0 ** 62, bits=64), dict(clip=True, scale=2.0, bits=8),
                                dict(clip=1.0, scale=2.0, bits=True), dict(clip=1.0, scale=float("nan"), bits=8)],
                         ids=["float32 clip at the bound", "2^63", "bool clip", "bool bits", "nan scale"])
def test_fixed_point_refuses_a_bound_no_value_fits(kw):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    with pytest.raises(ValueError):
        FixedPoint(**kw)


def test_fixed_point_just_under_two_to_the_63_encodes_the_clip_exactly():  # held
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    fp = FixedPoint(clip=1.0, scale=2.0 ** 62, bits=64)
    assert fp.signed(fp.quantize([1.0, -1.0])).tolist() == [2 ** 62, -2 ** 62]


def test_fixed_point_takes_a_numpy_integer_for_bits():
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    assert FixedPoint(clip=1.0, scale=2.0, bits=np.int64(8)).max_q == 2


# ================================================================================ (1, new code) History.privacy
@pytest.mark.parametrize("eps, delta", [([-2.0, -1.0], [1e-5, 1e-5]), ([1.0, 2.0], [5.0, 5.0]),
                                        ([1.0, 2.0], [1e-5, -1.0])], ids=["negative eps", "delta 5", "negative delta"])
def test_history_privacy_refuses_values_that_are_no_privacy_level(eps, delta):
    from fedlab_nb.core.history import History
    h = History(pd.DataFrame({"round": [0, 1], "epsilon": eps, "dp_delta": delta}))
    with pytest.raises(ValueError):
        h.privacy()


@pytest.mark.parametrize("column, values", [("epsilon", [1 + 1j, 2 + 0j]), ("round", ["0", "1"]),
                                            ("epsilon", [2.0, 1.0]), ("round", [1, 0])],
                         ids=["complex eps", "text round", "falling eps", "rounds out of order"])
def test_history_privacy_refuses_columns_stating_no_guarantee(column, values):  # held
    from fedlab_nb.core.history import History
    rows = {"round": [0, 1], "epsilon": [0.5, 1.0], "dp_delta": [1e-5, 1e-5]}
    with pytest.raises(ValueError):
        History(pd.DataFrame({**rows, column: values})).privacy()


def test_history_summary_of_an_infinite_epsilon_says_no_guarantee():  # held
    from fedlab_nb.core.history import History
    h = History(pd.DataFrame({"round": [0, 1], "epsilon": [1.0, float("inf")], "dp_delta": [1e-5, 1e-5]}))
    assert "no finite guarantee" in h.summary()


# ================================================================================ (new code, 5, 8) the board and list
def _result(root, name="tiny-smoke.json", raw=None, **fields):
    (root / "results").mkdir(exist_ok=True)
    data = raw if raw is not None else json.dumps({**RESULT, **fields}).encode()
    (root / "results" / name).write_bytes(data)


def _board(root):
    return "".join((root / "results" / f).read_text() for f in ("REPORT.md", "index.html"))


def test_a_paper_with_results_only_at_its_paper_scale_counts_once(tmp_path):  # held
    root = root_copy(tmp_path)
    _result(root, "tiny-paper.json", scale="paper")
    rc, out, err = cli(["--root", root, "report"])
    no_traceback(rc, err)
    assert "more results" not in out and "1 " in out


def test_results_at_two_scales_count_the_paper_once_and_name_the_other(tmp_path):  # held
    root = root_copy(tmp_path)
    _result(root)
    _result(root, "tiny-paper.json", scale="paper", verdict="not reproduced at this scale")
    rc, out, err = cli(["--root", root, "report"])
    no_traceback(rc, err)
    assert "1 more results" in out and "1 more results" in _board(root)


@pytest.mark.parametrize("verdict", [" reproduced", "Reproduced", "reproduced\u200b", "error\n"],
                         ids=["leading space", "capital", "zero width", "newline"])
def test_a_verdict_near_a_real_one_is_not_counted_as_it(tmp_path, verdict):  # held
    root = root_copy(tmp_path)
    _result(root, verdict=verdict)
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "not a result file" in out + err or "stale" in out + err


@pytest.mark.parametrize("paper", ["Tiny", "tiny ", "tin\u0443"], ids=["case", "space", "cyrillic u"])
def test_a_result_whose_paper_field_differs_from_its_name_is_refused(tmp_path, paper):  # held
    root = root_copy(tmp_path)
    _result(root, paper=paper)
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "reproduced" not in out.replace("not reproduced", "").split("tiny", 1)[-1].splitlines()[0:1] or rc in (0, 1)
    rc, out, err = cli(["--root", root, "report"])
    no_traceback(rc, err)
    assert clean(out + err) and clean(_board(root))


@pytest.mark.parametrize("scale", ["sm\u202eoke", "smoke\x1b[2J", "smoke\u2028x", "\ufeffsmoke"],
                         ids=["bidi", "escape", "line sep", "bom"])
def test_a_scale_name_with_controls_is_never_printed_raw(tmp_path, scale):  # held
    root = root_copy(tmp_path)
    _result(root, f"tiny-{scale}.json", scale=scale)
    for cmd in (["list"], ["report"]):
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
        assert clean(out + err)
    assert clean(_board(root))


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b"[" * 5000 + b"]" * 5000, b'{"paper": "tiny", "scale": "smoke", '
                                 b'"verdict": "reproduced", "claims": [], "metrics": {"v": 1e999}}', b"{" * 3],
                         ids=["not utf-8", "5000 deep", "1e999", "truncated"])
def test_a_corrupt_result_never_breaks_the_listing(tmp_path, raw):  # held
    root = root_copy(tmp_path)
    _result(root, "tiny-paper.json", scale="paper")
    _result(root, "tiny-smoke.json", raw=raw)
    for cmd in (["list"], ["report"]):
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
        assert "tiny" in out or cmd == ["report"]


# ================================================================================ (2, 4, new code) paths
def test_a_tilde_user_that_names_no_home_is_a_one_line_error(tmp_path):  # held
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "--results", "~no_such_user_42q/results", "list"])
    assert rc in (1, 2) and "Traceback" not in err and "raised" not in str(rc), (rc, err)


def test_a_relative_results_path_from_a_sub_folder_writes_under_it(tmp_path, monkeypatch):  # held
    root = root_copy(tmp_path)
    (root / "sub").mkdir()
    monkeypatch.chdir(root / "sub")
    rc, out, err = cli(["--root", "..", "--results", "res", "report"])
    no_traceback(rc, err)
    assert (root / "sub" / "res" / "REPORT.md").is_file() and not (root / "res").exists()


@pytest.mark.parametrize("name, value", [("n_po\x1bints", "4"), ("n_points", "\u202e4"), ("n_points", "&a [*a, *a]"),
                                         ("n_points", '!!python/object/apply:os.system ["echo x"]'),
                                         ("n_points", "1e999")],
                         ids=["escape name", "bidi value", "recursive alias", "python tag", "1e999"])
def test_a_hostile_p_value_is_refused_cleanly_before_a_kernel(tmp_path, name, value):  # held
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "run", "tiny", "-p", name, value])
    assert rc == 2 and "Traceback" not in err and clean(out + err), (rc, err)
    assert not (root / "results").exists()


def test_a_yaml_alias_bomb_in_a_scale_is_a_one_line_error(tmp_path):  # held
    bomb = 'x: &a ["b","b","b","b","b","b","b","b","b"]\n' + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    root = root_copy(tmp_path, lambda t: bomb + t)
    rc, out, err = cli(["--root", root, "list"])
    assert rc in (0, 1, 2) and "Traceback" not in err and "raised" not in str(rc), (rc, err)
    assert len(err.strip().splitlines()) <= 2


# ================================================================================ (new code) numbers as floats
def test_classic_sigma_with_an_m_past_float64_is_a_value_error():
    from fedlab_nb.methods.more.dp_robust import classic_sigma
    with pytest.raises(ValueError, match="m"):
        classic_sigma(1.0, 10 ** 400, 0.5, 1e-5)


@pytest.mark.parametrize("call", [
    lambda A, S: A.epsilon(0.1, 1.0, 10 ** 20, 1e-5), lambda A, S: A.epsilon(0.1, 1.0, np.uint64(10), 1e-5),
    lambda A, S: A.epsilon(5e-324, 1.0, 10, 1e-5), lambda A, S: A.noise_for_epsilon(1e-300, 0.1, 10, 1e-5),
    lambda A, S: S.noise_multiplier_for(1e-300, 1e-5, 0.1, 10, 1),
    lambda A, S: S.spent_epsilon(1.0, 1e-5, 0.1, 10, 10)],
    ids=["10^20 steps", "uint64 steps", "subnormal q", "tiny target", "fedsvd tiny target", "fedsvd spent"])
def test_accounting_at_extreme_inputs_gives_a_valid_number_or_a_value_error(call):  # held
    from fedlab_nb.methods.privacy import accounting as A
    from fedlab_nb.methods.privacy import fedsvd as S
    try:
        value = call(A, S)
    except ValueError:
        return
    assert isinstance(value, float) and value >= 0 and not np.isnan(value)


def test_noise_for_a_huge_target_epsilon_is_refused_as_no_privacy():  # held
    from fedlab_nb.methods.privacy.accounting import noise_for_epsilon
    with pytest.raises(ValueError, match="no privacy"):
        noise_for_epsilon(1e300, 0.1, 10, 1e-5)


# ================================================================================ (6) Flower replies, variants
def _flower(fed, k0, **over):
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed)
    s.aggregate_train(1, [flower_reply(s, k, **(over if k == k0 else {})) for k in range(3)])
    return s


@pytest.mark.parametrize("k0, over", [(0, {"num-examples": "rows+1"}), (1, {"train-loss": float("inf")}),
                                      (2, {"client-id": 2.0}), (1, {"client-id": True}),
                                      (0, {"num-examples": 0.5})],
                         ids=["one row too many", "inf loss", "float id", "bool id", "half an example"])
def test_a_flower_reply_just_past_the_rules_is_refused_naming_its_client(fed10, k0, over):  # held
    over = {n: int(fed10.sizes[k0]) + 1 if v == "rows+1" else v for n, v in over.items()}
    with pytest.raises(ValueError, match=f"client {k0}"):
        _flower(fed10, k0, **over)


def test_a_flower_reply_of_exactly_its_rows_as_a_float_is_taken(fed10):  # held
    s = _flower(fed10, 0, **{"num-examples": float(fed10.sizes[0])})
    assert torch.isfinite(torch.as_tensor(np.asarray(s.theta))).all()


# ================================================================================ (3, 7, 8) links, FIFOs, devices
@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_a_hard_link_at_the_board_never_writes_the_other_file(tmp_path, name):  # held
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("KEEP")
    os.link(victim, root / "results" / name)
    rc, out, err = cli(["--root", root, "report"])
    no_traceback(rc, err)
    assert victim.read_text() == "KEEP"


@pytest.mark.parametrize("how", ["fifo", "/dev/zero"])
def test_a_result_that_is_a_fifo_or_a_device_is_stale_not_a_hang(tmp_path, how):  # held
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    target = root / "results" / "tiny-smoke.json"
    os.mkfifo(target) if how == "fifo" else os.symlink(how, target)
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "tiny-smoke.json" in err and "stale" in err


@pytest.mark.parametrize("how", ["fifo", "/dev/zero"])
def test_a_claims_file_that_is_a_fifo_or_a_device_is_invalid_not_a_hang(tmp_path, how):  # held
    root = root_copy(tmp_path)
    claims = root / "papers" / "tiny.yaml"
    claims.unlink()
    os.mkfifo(claims) if how == "fifo" else os.symlink(how, claims)
    rc, out, err = cli(["--root", root, "list"])
    assert rc == 1 and "Traceback" not in err and "INVALID" in out + err


def test_a_history_that_is_a_fifo_is_a_one_line_error(tmp_path):  # held
    root = root_copy(tmp_path)
    os.mkfifo(tmp_path / "h.csv")
    rc, out, err = cli(["--root", root, "history", tmp_path / "h.csv"])
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


# =========================================================================== (4, 8) a result at a scale the paper lacks
def test_a_result_at_a_scale_the_paper_lacks_is_not_shown_as_a_verdict(tmp_path):
    root = root_copy(tmp_path)
    _result(root, verdict="not reproduced at this scale")
    _result(root, "tiny-huge.json", scale="huge")
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "huge: reproduced" not in out and "tiny-huge.json" in err
    cli(["--root", root, "report"])
    assert "(huge): reproduced" not in _board(root)


@pytest.mark.parametrize("make", [lambda: [], lambda: np.array([]), lambda: np.empty((0, 3)), lambda: ()],
                         ids=["list", "float array", "2-D", "tuple"])
def test_an_empty_sample_of_any_shape_still_releases_noise_and_accounts(fed10, make):  # held
    from probes import declared, trace
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg
    h, seen = trace(dp_fedavg(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.1), fed10,
                    declared(lambda r, K, g: make(), 0.1), 3)
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))
    assert h["epsilon"].notna().all() and h["epsilon"].is_monotonic_increasing


# ================================================================================ (4, 5) a result's figures field
@pytest.mark.parametrize("figures", [{"a": "sub/../../../victim.png", "b": "/dev/zero"}, {"a\x1b[2J": "f.png"}],
                         ids=["dot-dot under a folder, a device", "escape name"])
def test_a_hostile_figures_field_is_never_followed_nor_printed_raw(tmp_path, figures):  # held
    from probes import PNG
    root = root_copy(tmp_path)
    (tmp_path / "victim.png").write_bytes(PNG)
    _result(root, figures=figures)
    (root / "results" / "f.png").write_bytes(PNG)
    for cmd in (["figures", "update", "tiny"], ["report"]):  # (about 5 s each: figures loads the plotting stack)
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
        assert clean(out + err)
    assert (tmp_path / "victim.png").read_bytes() == PNG and clean(_board(root))
