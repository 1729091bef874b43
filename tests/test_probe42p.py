"""Probe 42p: a sixteenth, independent re-run of issue 42's failure classes, aimed first at what is new since the
fifteenth (the exact binomial check of a DP sampler, FixedPoint's one-value bound, History's shared metadata,
printable_name, read_result's name check, the Flower reply's rows_held) with variants the earlier
test_probe42*.py do not try: fair Poisson and fixed samplers over 3,000 rounds at odd (K, q), a sampler a little
too keen on one client, clip·scale that rounds up to 2^(bits-1), a History saved over another run's metadata,
Flower replies all claiming zero rows, result files whose scale field differs only in case, escapes and lone
surrogates in a result's notes, relative --results from a sub-folder, a results path that is a file, links at the
board and the lab folder. Each test asserts the correct behaviour; a test marked xfail(strict=True) is an open
finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

from probes import RESULT, cli, fed10, root_copy  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_
from probes import clean, no_traceback
from probes import sampling_check_run as _check_run


# ================================================================================ (1, new code) the sampling check
def _poisson(q):
    return lambda r, K, g: np.flatnonzero(g.random(K) < q)


@pytest.mark.parametrize("K, q", [(10, 0.1), (2, 0.5), (1000, 0.001), (3, 0.9), (100, 0.3), (1, 0.5)])
def test_a_fair_poisson_sampler_is_never_refused_over_3000_rounds(K, q):  # held
    assert [_check_run(K, q, "poisson", _poisson(q), 3000, seed) for seed in range(2)] == [None, None]


@pytest.mark.parametrize("K, m", [(10, 1), (4, 3), (1000, 1), (100, 30)])
def test_a_fair_fixed_sampler_is_never_refused_over_3000_rounds(K, m):  # held
    assert _check_run(K, m / K, "fixed", lambda r, K, g: g.choice(K, m, replace=False), 3000) is None


@pytest.mark.parametrize("pick", [
    lambda r, K, g: np.union1d([0], np.flatnonzero(g.random(K) < 0.1)),           # client 0 every round
    lambda r, K, g: np.flatnonzero(g.random(K) < np.r_[0.2, [0.1] * 9]),         # client 0 at twice q
    lambda r, K, g: np.flatnonzero(g.random(K) < 0.12),                           # everyone a fifth too often
    lambda r, K, g: np.arange(K) if g.random() < 0.1 else np.array([], int)],     # all or nobody: rate q, not Poisson
    ids=["one client always", "one client at 2q", "q=0.12 for 0.1", "all or nobody"])
def test_a_poisson_sampler_a_little_too_keen_is_refused_in_time(pick):  # held
    assert _check_run(10, 0.1, "poisson", pick, 3000) is not None


def test_a_fixed_sampler_favouring_one_client_is_refused(fed10):  # held
    pick = lambda r, K, g: np.array([0]) if r % 2 else np.array([1 + r // 2 % 9])  # noqa: E731
    assert _check_run(10, 0.1, "fixed", pick, 500) is not None


def test_a_custom_fixed_sampler_for_a_non_whole_qk_is_refused_before_round_one(fed10):  # held
    import fedlab_nb as fl
    from probes import KW, declared
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg
    sampler = declared(lambda r, K, g: g.choice(K, 2, replace=False), 0.15, "fixed")
    with pytest.raises(ValueError, match="whole number"):
        fl.simulate(dp_fedavg(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.15, sampling="fixed"), fed10,
                    rounds=2, clients_per_round=sampler, seed=0, **KW)


# ================================================================================ (new code) FixedPoint's one value
@pytest.mark.parametrize("kw", [dict(clip=1.0, scale=1.6, bits=2), dict(clip=1.0, scale=2 ** 31 - 0.4, bits=32)],
                         ids=["bits 2", "bits 32"])
def test_fixed_point_never_wraps_one_clipped_value(kw):
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    try:
        fp = FixedPoint(**kw)
    except ValueError as e:
        assert "bits" in str(e)
        return
    assert fp.dequantize(fp.quantize([1.0]))[0] > 0


# ================================================================================ (new code) History's metadata
def test_history_saved_at_another_runs_metadata_file_is_refused(tmp_path):  # held
    from fedlab_nb.core.history import History
    a = History(pd.DataFrame({"round": [0, 1], "acc": [0.1, 0.2]}))
    a.meta = {"who": "a"}
    a.save(tmp_path / "run")
    with pytest.raises(ValueError):
        History(pd.DataFrame({"round": [0], "acc": [0.9]})).save(tmp_path / "run.json")
    assert History.load(tmp_path / "run").meta == {"who": "a"}


@pytest.mark.parametrize("column, values", [("epsilon", [True, True]), ("dp_delta", ["1e-5", "x"]),
                                            ("round", [0.0, float("nan")])],
                         ids=["bool eps", "text delta", "nan round"])
def test_history_privacy_refuses_columns_that_state_no_guarantee(column, values):
    from fedlab_nb.core.history import History
    rows = {"round": [0, 1], "epsilon": [0.5, 1.0], "dp_delta": [1e-5, 1e-5]}
    h = History(pd.DataFrame({**rows, column: values}))
    with pytest.raises(ValueError):
        h.privacy()


# ================================================================================ (8) a result's verdict vocabulary
def _board(root):
    return "".join((root / "results" / f).read_text() for f in ("REPORT.md", "index.html"))


def _result(root, name="tiny-smoke.json", **fields):
    (root / "results").mkdir(exist_ok=True)
    (root / "results" / name).write_text(json.dumps({**RESULT, **fields}))


def test_a_result_with_a_verdict_that_is_no_verdict_is_stale(tmp_path):
    root = root_copy(tmp_path)
    _result(root, verdict="great", claims=[{**RESULT["claims"][0], "verdict": "great"}])
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    rc, out2, err2 = cli(["--root", root, "report"])
    no_traceback(rc, err2)
    assert "great" not in out + (root / "results" / "REPORT.md").read_text(), out


@pytest.mark.parametrize("field", ["note", "expect", "id"])
def test_escapes_and_lone_surrogates_in_a_results_claim_never_print_raw(tmp_path, field):  # held
    root = root_copy(tmp_path)
    _result(root, claims=[{**RESULT["claims"][0], field: "a\ud800b\x1b[2J\u202ec\x85"}])
    for cmd in (["list"], ["list", "--claims"], ["report"]):
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
        board = _board(root) if cmd == ["report"] else ""
        assert clean(out + err + board) and "\ud800" not in out + err + board, cmd


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "1" * 5000], ids=["inf", "-inf", "nan", "5000 digits"])
def test_a_result_with_non_finite_or_huge_metrics_is_one_line_on_every_printer(tmp_path, number):
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    text = json.dumps(RESULT).replace('"value": 1.0', f'"value": {number}')
    (root / "results" / "tiny-smoke.json").write_text(text)
    for cmd in (["list"], ["list", "--claims"], ["report"]):
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
        assert len(max((out + err).splitlines(), key=len, default="")) < 2000, cmd


def test_a_result_whose_scale_field_differs_only_in_case_is_not_that_scale(tmp_path):  # held
    root = root_copy(tmp_path)
    _result(root, scale="SMOKE")
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "smoke: reproduced" not in out, out


# ================================================================================ (7) results path that is a file
@pytest.mark.parametrize("cmd", [["list"], ["report"], ["history", "h.csv"], ["reproduce", "tiny", "-j", "1"]])
def test_a_results_path_that_is_a_file_is_one_line_naming_it(tmp_path, cmd):  # held
    root = root_copy(tmp_path)
    (root / "afile").write_text("x")
    rc, out, err = cli(["--root", root, "--results", root / "afile", *cmd])
    assert rc not in (0, None) and "Traceback" not in err and "raised" not in str(rc), (rc, err)
    assert len(err.strip().splitlines()) == 1, err


# ================================================================================ (2) relative --results everywhere
@pytest.mark.parametrize("results", ["./x/../res", "res/", "res//sub"])
def test_odd_relative_results_from_a_sub_folder_for_report_and_list(tmp_path, monkeypatch, results):  # held
    root = root_copy(tmp_path)
    (root / "sub").mkdir()
    monkeypatch.chdir(root / "sub")
    for cmd in (["report"], ["list"], ["params", "tiny"]):
        rc, out, err = cli(["--root", "..", "--results", results, *cmd])
        assert rc == 0 and "Traceback" not in err, (cmd, rc, err)
    assert (root / "sub" / results / "REPORT.md").is_file()


def test_relative_env_results_with_an_absolute_root_writes_one_board(tmp_path, monkeypatch):  # held
    root = root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLAB_NB_RESULTS", "envres")
    rc, out, err = cli(["--root", root, "report"])
    assert rc == 0, err
    assert [p for p in (tmp_path / "envres", root / "envres") if (p / "REPORT.md").is_file()], out


# ================================================================================ (3) links at the board
@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_a_dangling_link_at_the_board_is_never_written_through(tmp_path, name):  # held
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    target = tmp_path / "outside" / name
    target.parent.mkdir()
    (root / "results" / name).symlink_to(target)
    rc, out, err = cli(["--root", root, "report"])
    assert "Traceback" not in err and not target.exists(), (rc, err)


def test_a_read_only_results_folder_is_one_line(tmp_path):
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    with pytest.MonkeyPatch.context() as m:
        import fedlab_nb.repro.files as files

        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied", str(root / "results"))
        m.setattr(files.tempfile, "mkstemp", refuse)
        rc, out, err = cli(["--root", root, "report"])
    assert rc not in (0, None) and "Traceback" not in err and "raised" not in str(rc), (rc, err)


# ================================================================================ (6, new code) Flower replies
def test_flower_replies_all_claiming_zero_rows_are_refused_or_move_nothing(fed10):
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    replies = [flower_reply(s, k, **{"num-examples": 0}) for k in range(3)]
    try:
        s.aggregate_train(1, replies)
    except ValueError as e:
        assert "num-examples" in str(e) or "client" in str(e)
        return
    assert torch.isfinite(torch.as_tensor(np.asarray(s.theta))).all()


@pytest.mark.parametrize("delta", ["short", "float64", "nan"])
def test_flower_reply_with_an_odd_delta_is_refused_naming_the_client(fed10, delta):
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    n = s.theta.numel()
    bad = {"short": np.zeros(n - 1, np.float32), "float64": np.zeros(n, np.float64),
           "nan": np.full(n, np.nan, np.float32)}[delta]
    replies = [flower_reply(s, k, delta=bad if k == 1 else None) for k in range(3)]
    with pytest.raises(ValueError, match="client 1"):
        s.aggregate_train(1, replies)


# ================================================================================ (4, 8) claims files handed to us
@pytest.mark.parametrize("encode", [lambda t: b"\xef\xbb\xbf" + t.encode(), lambda t: t.encode("utf-16"),
                                    lambda t: t.encode()[:200] + b"\xff\xfe" + t.encode()[200:]],
                         ids=["bom", "utf-16", "a bad byte"])
def test_an_odd_encoding_of_a_claims_file_is_one_line_or_read(tmp_path, encode):  # held
    root = root_copy(tmp_path)
    p = root / "papers" / "tiny.yaml"
    p.write_bytes(encode(p.read_text()))
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)


@pytest.mark.parametrize("scale", ["smoke/../../x", "a\\..\\..\\x", ".", "..", "a\x00b", "-rf"])
def test_an_odd_scale_name_never_runs_or_writes_outside(tmp_path, scale):  # held
    from unittest import mock

    from fedlab_nb.repro import runner
    root = root_copy(tmp_path, lambda t: t.replace("  paper: {device: cpu,", f"  {json.dumps(scale)}: {{device: cpu,"))
    with mock.patch.object(runner, "_execute", side_effect=AssertionError("a kernel was started")):
        rc, out, err = cli(["--root", root, "reproduce", "tiny", "--scale", scale, "-j", "1"])
    assert "kernel was started" not in str(rc) + out + err and "Traceback" not in err, (rc, err)
    assert not (tmp_path / "x").exists() and not (root / "x").exists()


@pytest.mark.parametrize("value", ["1e999", ".inf", ".nan", "1e308", "1_000"], ids=lambda v: v)
def test_p_values_that_are_no_finite_number_are_refused_before_a_kernel(tmp_path, value):
    from unittest import mock

    from fedlab_nb.repro import runner
    root = root_copy(tmp_path)
    with mock.patch.object(runner, "_execute", side_effect=AssertionError("a kernel was started")):
        rc, out, err = cli(["--root", root, "run", "tiny", "-p", "n_points", value])
    assert "kernel was started" not in str(rc) + out + err and "Traceback" not in err, (rc, out, err)


def test_flower_two_replies_from_one_client_are_refused_naming_it(fed10):  # held
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    with pytest.raises(ValueError, match="client ids|client 0"):
        s.aggregate_train(1, [flower_reply(s, 0), flower_reply(s, 0), flower_reply(s, 1)])


# ================================================================================ (3, 8) what sits at a claims file
@pytest.mark.parametrize("make", ["loop", "to /dev/zero", "to a folder", "fifo", "sparse 1.2 GB"])
def test_odd_things_at_a_claims_file_are_one_line_each_and_tiny_still_lists(tmp_path, make):  # held
    root = root_copy(tmp_path)
    p = root / "papers" / "odd.yaml"
    if make == "loop":
        p.symlink_to("odd.yaml")
    elif make == "to /dev/zero":
        p.symlink_to("/dev/zero")
    elif make == "to a folder":
        p.symlink_to(tmp_path)
    elif make == "fifo":
        os.mkfifo(p)
    else:
        with p.open("wb") as f:
            f.write(b"id: odd\n#")
            f.truncate(1200 << 20)
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "tiny" in out and len([ln for ln in (out + err).splitlines() if "odd" in ln]) == 1, out + err


# ================================================================================ (1, new code) calibration
@pytest.mark.parametrize("target, accountant", [(1e-300, "rdp"), (1e-6, "rdp"), (1e-3, "pld"), (0.5, "pld")])
def test_noise_for_a_tiny_epsilon_meets_it_under_its_own_accountant(target, accountant):  # held
    from fedlab_nb.methods.privacy import accounting as A
    z = A.noise_for_epsilon(target, 0.1, 3, 1e-5, accountant)
    assert np.isfinite(z) and A.epsilon(0.1, z, 3, 1e-5, accountant) <= target * (1 + 1e-6)


@pytest.mark.parametrize("steps", [3.0, True, -1, "3"], ids=["float", "bool", "negative", "text"])
def test_accounting_steps_must_be_a_whole_count(steps):  # held
    from fedlab_nb.methods.privacy import accounting as A
    with pytest.raises(ValueError, match="steps"):
        A.epsilon(0.1, 1.0, steps, 1e-5)


# ================================================================================ (3, new code) the runs folder
@pytest.mark.parametrize("where", ["results/runs", "results/runs/<folder>"])
def test_run_with_a_link_on_its_output_path_is_refused_before_a_kernel(tmp_path, where):  # held
    from unittest import mock

    from fedlab_nb.repro import runner
    root = root_copy(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "results" / "runs").mkdir(parents=True)
    if where == "results/runs":
        (root / "results" / "runs").rmdir()
        (root / "results" / "runs").symlink_to(outside)
    else:
        from fedlab_nb.repro.claims import load_paper
        paper = load_paper("tiny", root)
        params, _ = runner.build_parameters(paper, "smoke", None, None)
        runner.run_folder("tiny", "smoke", params, root / "results", first=[]).symlink_to(outside)
    with mock.patch.object(runner, "_execute", side_effect=AssertionError("a kernel was started")):
        rc, out, err = cli(["--root", root, "run", "tiny"])
    assert rc not in (0, None) and "kernel was started" not in str(rc) + err and "link" in err, (rc, err)
    assert list(outside.iterdir()) == []


# ================================================================================ (5) a corrupt result's own name
@pytest.mark.parametrize("name", ["tiny-sm\x1b[2Joke.json", "tiny-smoke\u202e.json", "tiny-a\\u001b.json"],
                         ids=["escape", "bidi", "an escaped escape"])
def test_a_corrupt_result_with_control_characters_in_its_name_prints_clean(tmp_path, name):  # held
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    (root / "results" / name).write_text("{corrupt")
    for cmd in (["list"], ["report"]):
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
        board = _board(root) if cmd == ["report"] else ""
        assert clean(out + err + board), (cmd, out + err)


# ================================================================================ (new code) History.privacy
def test_history_privacy_refuses_a_complex_delta_column():
    from fedlab_nb.core.history import History
    h = History(pd.DataFrame({"round": [0, 1], "epsilon": [0.5, 1.0], "dp_delta": [1e-5 + 0j, 1e-5 + 1j]}))
    with pytest.raises(ValueError, match="dp_delta"):
        h.privacy()


# ================================================================================ (7, 8, new code) data fetch
def _cifar_archive(path, extra=b""):
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/a")
        info.size = 1000
        tar.addfile(info, io.BytesIO(os.urandom(1000)))
    path.write_bytes(path.read_bytes() + extra)


@pytest.mark.parametrize("case", ["a full disk while extracting", "garbage after the gzip stream",
                                  "a second gzip member with a bad CRC"])
def test_data_fetch_of_an_odd_archive_or_a_full_disk_is_one_line(tmp_path, case):  # held
    import errno
    import gzip
    import tarfile
    from unittest import mock
    folder = tmp_path / "d"
    folder.mkdir()
    extra = {"garbage after the gzip stream": b"garbage!!",
             "a second gzip member with a bad CRC": gzip.compress(b"x" * 10)[:-8] + b"\0" * 8}.get(case, b"")
    _cifar_archive(folder / "cifar-10-python.tar.gz", extra)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    extract = full if case.startswith("a full") else tarfile.TarFile.extractall
    with mock.patch.object(tarfile.TarFile, "extractall", extract):
        rc, out, err = cli(["--root", root_copy(tmp_path), "data", "fetch", "cifar10", "--dir", folder])
    assert rc not in (0, None) and "raised" not in str(rc) and "Traceback" not in err, (rc, err)
    assert len(err.strip().splitlines()) == 1 and "cifar" in err, err


# ================================================================================ (4) requires, never imported
@pytest.mark.parametrize("name", ["evilmod", "evilmod.sub", "evilpkg.inner"])
def test_requires_entries_are_never_imported_by_any_command(tmp_path, monkeypatch, name):  # held
    (tmp_path / "evilmod.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('x')\n")
    (tmp_path / "evilpkg").mkdir()
    (tmp_path / "evilpkg" / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb",
                                                   f"notebook: notebooks/tiny.ipynb\nrequires: [{name}]"))
    for cmd in (["list"], ["list", "--claims"], ["params", "tiny"], ["report"]):
        rc, out, err = cli(["--root", root, *cmd])
        no_traceback(rc, err)
    assert not (tmp_path / "imported").exists()


# ================================================================================ (7) one run of a paper at a time
def test_a_second_run_while_the_lock_is_held_is_one_line_and_non_zero(tmp_path):  # held
    from unittest import mock

    from fedlab_nb.repro import runner
    from fedlab_nb.repro.files import run_lock
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    with run_lock(root / "results", "tiny", "paper"), \
            mock.patch.object(runner, "_execute", side_effect=AssertionError("a kernel was started")):
        for cmd in (["reproduce", "tiny", "-j", "1"], ["run", "tiny"]):
            rc, out, err = cli(["--root", root, *cmd])
            assert rc not in (0, None) and "kernel was started" not in str(rc) + err, (cmd, rc, err)
            assert "another run of tiny" in err and "Traceback" not in err, err


# ================================================================================ (out of class) the board's counts
def test_the_board_counts_a_paper_with_two_scales_once(tmp_path):
    root = root_copy(tmp_path)
    _result(root)
    _result(root, "tiny-paper.json", scale="paper")
    rc, out, err = cli(["--root", root, "report"])
    assert rc == 0, err
    assert "2 papers" not in out and "1 paper" in out, out


# ================================================================================ (1) DP variants end to end
def test_adaptive_clip_with_mostly_empty_rounds_releases_noise_every_round(fed10):  # held
    from probes import trace
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.05,
                                             adaptive=True, clip_count_stddev=1.0)
    h, seen = trace(method, fed10, sampler, 6)
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:])), "a round released θ unchanged"
    assert np.isfinite(h["epsilon"]).all() and (np.diff(h["epsilon"]) > 0).all()


def test_adaptive_dp_resumed_mid_run_equals_the_uninterrupted_run(fed10, tmp_path):  # held
    import fedlab_nb as fl
    from probes import KW, interrupted_dp_run
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    privacy = dict(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.3, adaptive=True, clip_count_stddev=1.0)
    method, sampler = dp_fedavg_with_sampler(fed10, **privacy)
    full = fl.simulate(method, fed10, rounds=4, clients_per_round=sampler, seed=0, **KW)
    ck = tmp_path / "ck.pt"
    interrupted_dp_run(fed10, ck, **privacy)
    method, sampler = dp_fedavg_with_sampler(fed10, **privacy)
    resumed = fl.simulate(method, fed10, rounds=4, clients_per_round=sampler, seed=0, checkpoint=ck, resume=True, **KW)
    assert list(resumed["epsilon"]) == list(full["epsilon"])
    assert np.allclose(resumed["clip_norm"], full["clip_norm"])


# ================================================================================ (5, 8) the figures' stored data
@pytest.mark.parametrize("content", [
    "{corrupt", "[" * 100000 + "]" * 100000, '{"figures": {"../../x": [1, 2]}}',
    '{"figures": {"a\\u001b[2J\\u202eb": {"series": [{"name": "s\\u001b]0;x\\u0007", "x": [1], "y": [1e999]}]}}}'],
    ids=["corrupt", "deep", "a path as a name", "escapes and inf"])
def test_figures_check_with_hostile_stored_data_is_one_clean_line(tmp_path, content):  # held
    root = root_copy(tmp_path)
    (root / "papers" / "figures").mkdir()
    (root / "papers" / "figures" / "tiny.json").write_text(content)
    (root / "results" / "tiny-smoke").mkdir(parents=True)
    rc, out, err = cli(["--root", root, "figures", "check", "tiny", "--from", root / "results" / "tiny-smoke"])
    assert rc not in (0, None) and "raised" not in str(rc) and "Traceback" not in err, (rc, err)
    assert len(err.strip().splitlines()) == 1 and clean(out + err), err
    assert not (tmp_path / "x").exists()


# ============================================================================ (new code) printable_name, read_result
def test_printable_name_is_one_to_one_over_tricky_names():  # held
    import itertools
    from fedlab_nb.repro.results import printable_name
    parts = ["a", "\\", "\t", "\\u0009", "\udcff", "\\xff", "\u200b", "\\u200b", "x", "\U000e0041", "\\U000e0041", "\n"]
    names = {"".join(p) for n in (1, 2, 3) for p in itertools.product(parts, repeat=n)}
    shown = {}
    for name in names:
        assert shown.setdefault(printable_name(name), name) == name, (name, shown[printable_name(name)])
        assert clean(printable_name(name)) and "\t" not in printable_name(name)


@pytest.mark.parametrize("paper", ["Tiny", "tiny ", "other"])
def test_a_result_whose_paper_field_disagrees_with_its_name_is_not_listed_as_tiny(tmp_path, paper):  # held
    root = root_copy(tmp_path)
    _result(root, paper=paper)
    rc, out, err = cli(["--root", root, "list"])
    no_traceback(rc, err)
    assert "smoke: reproduced" not in out, out


# ================================================================================ (1, 8) a custom sampler's id dtype
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.uint8], ids=["int8", "uint16", "uint8"])
def test_a_sampler_returning_small_integer_ids_runs_or_is_named(fed10, dtype):
    import fedlab_nb as fl
    from probes import KW
    try:
        h = fl.simulate("fedavg", fed10, rounds=1, clients_per_round=lambda r, K, g: np.array([2, 3], dtype=dtype),
                        seed=0, **KW)
    except ValueError as e:
        assert "sampler" in str(e)
        return
    ref = fl.simulate("fedavg", fed10, rounds=1, clients_per_round=lambda r, K, g: np.array([2, 3]), seed=0, **KW)
    assert h["test_acc"].iloc[-1] == ref["test_acc"].iloc[-1]
