"""Probe 42n: a fourteenth, independent re-run of issue 42's failure classes, aimed first at what is new since the
thirteenth (utils.check_number and the DP entry points it now guards, History.privacy's last row, the OSError
wording on reads, publish's set-aside and put-back, the claims file's value limit, data fetch's archive, the loss
check's rows, backend='auto') and at variants the earlier test_probe42*.py do not try: the locational-DP
mechanisms' region ids, NaN values and draws, the randomised-response audits past ε ≈ 745, NormClipping's weak-DP
noise, a tilde in the results path, a History CSV whose rows are out of order, an interrupt right after publish
sets the old figures aside, hard links at the result file, escapes in a History sidecar, deep or wide claims
files, a truncated data archive, a claims file's NaN reaching figures update, secure aggregation's fixed point, a
custom DP sampler in a short run, CIFAR batches unpickled, an ignored class only in the clients' data and
History.save stopped between its two files. Each test asserts the correct behaviour; a test marked
xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import errno
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from probes import KW as RUN
from probes import cli, fed10, one_line_error, root_copy, trace  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_
from probes import (CONTROL, RESULT, clean as _clean, no_traceback as _no_traceback, interrupted_dp_run)  # noqa: F401


def _refused_or_finite(call, match):
    """A DP helper given a bad number either refuses it (a ValueError naming the argument) or answers a finite
    number; a bare OverflowError / TypeError, a solver's message, or an inf / NaN answer is the finding."""
    try:
        out = call()
    except ValueError as e:
        assert any(word in str(e) for word in match.split("|")), str(e)
        return
    assert np.isfinite(np.asarray(out, dtype=float)).all(), out


# ================================================================================ (new code) check_number's inputs
@pytest.mark.parametrize("call", ["bag responses epsilon 10**400", "region means sigma 10**400",
                                  "check_number 10**400"])
def test_check_number_refuses_an_integer_past_float64_naming_it(call):
    from fedlab_nb.methods.beyond import locational_dp as L
    from fedlab_nb.methods.privacy import aggregate_responses as A
    from fedlab_nb.utils import check_number
    rng = np.random.default_rng(0)
    calls = {"bag responses epsilon 10**400": lambda: A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng),
                                                                         10 ** 400, 1.0, rng),
             "region means sigma 10**400": lambda: L.private_region_means([0, 1], [0.2, 0.5], 2, 1.0, 10 ** 400, rng),
             "check_number 10**400": lambda: check_number("epsilon", 10 ** 400, 0)}
    with pytest.raises(ValueError, match="epsilon|sigma"):
        calls[call]()


@pytest.mark.parametrize("value", [np.float16(0.5), np.int32(3), 2.0 ** -1022],
                         ids=["numpy float16", "numpy int32", "smallest normal"])
def test_check_number_takes_numpy_and_tiny_real_numbers(value):  # held
    from fedlab_nb.utils import check_number
    assert check_number("x", value, 0) == float(value)


@pytest.mark.parametrize("value", [complex(1, 0), np.array([1.0]), "1", b"1", [1.0], None, np.bool_(True)],
                         ids=["complex", "array", "text", "bytes", "list", "None", "numpy bool"])
def test_check_number_refuses_what_is_not_one_real_number(value):  # held
    from fedlab_nb.utils import check_number
    with pytest.raises(ValueError, match="x must be"):
        check_number("x", value, 0)


# ================================================================================ (1) DP: locational_dp variants
@pytest.mark.parametrize("case", ["epsilon 800", "sensitivity 1e-320", "sensitivity 1e308"])
def test_locational_gaussian_sigma_at_extreme_arguments_names_them_or_answers(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    args = {"epsilon 800": (800.0, 1e-5, 1.0), "sensitivity 1e-320": (1.0, 1e-5, 1e-320),
            "sensitivity 1e308": (1.0, 1e-5, 1e308)}[case]
    _refused_or_finite(lambda: L.gaussian_sigma(*args), "epsilon|sensitivity")


def test_dp_robust_gaussian_sigma_with_a_tiny_delta_names_it_or_answers():
    from fedlab_nb.methods.more import dp_robust as D
    _refused_or_finite(lambda: D.gaussian_sigma(1.0, 10, 1.0, 1e-300), "delta")


@pytest.mark.parametrize("case", ["dp_robust classic_sigma", "locational central_count_std"])
def test_a_subnormal_epsilon_gives_a_finite_sigma_or_is_refused(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    from fedlab_nb.methods.more import dp_robust as D
    call = {"dp_robust classic_sigma": lambda: D.classic_sigma(1.0, 10, 1e-320, 1e-5),
            "locational central_count_std": lambda: L.central_count_std(1e-320)}[case]
    _refused_or_finite(call, "epsilon")


def test_private_region_means_with_a_nan_value_is_refused():
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    try:
        out = L.private_region_means([0, 1, 1], [np.nan, 0.5, 0.2], 2, 1.0, 1.0, rng)
    except ValueError as e:
        assert "NaN" in str(e) or "nan" in str(e)
        return
    assert np.isfinite(out).all(), out


@pytest.mark.parametrize("case", ["means region -1", "means region 5 of 2", "means region 0.7",
                                  "shares region -1", "shares region 7 of 2"])
def test_region_ids_out_of_range_are_refused_naming_them(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    calls = {"means region -1": lambda: L.private_region_means([0, -1], [0.5, 0.5], 2, 1.0, 1.0, rng),
             "means region 5 of 2": lambda: L.private_region_means([0, 5], [0.5, 0.5], 2, 1.0, 1.0, rng),
             "means region 0.7": lambda: L.private_region_means([0.7, 1], [0.5, 0.5], 2, 1.0, 1.0, rng),
             "shares region -1": lambda: L.private_region_shares([0, -1], [0, 1], 2, 1.0, rng),
             "shares region 7 of 2": lambda: L.private_region_shares([0, 7], [0, 1], 2, 1.0, rng)}
    with pytest.raises(ValueError, match="region"):
        calls[case]()


@pytest.mark.parametrize("case", ["shares draws 2**40", "means draws -1", "means draws 1.5"])
def test_region_releases_check_draws(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    calls = {"shares draws 2**40": lambda: L.private_region_shares([0, 1], [0, 1], 2, 1.0, rng, draws=2 ** 40),
             "means draws -1": lambda: L.private_region_means([0, 1], [0.2, 0.5], 2, 1.0, 1.0, rng, draws=-1),
             "means draws 1.5": lambda: L.private_region_means([0, 1], [0.2, 0.5], 2, 1.0, 1.0, rng, draws=1.5)}
    with pytest.raises(ValueError, match="draws"):
        calls[case]()


@pytest.mark.parametrize("epsilon,ok", [(True, False), (np.int64(3), True)], ids=["True refused", "numpy int taken"])
def test_randomized_response_epsilon_types_as_check_number(epsilon, ok):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    if ok:
        assert L.randomized_response([0, 1], 2, epsilon, rng).shape == (2,)
    else:
        with pytest.raises(ValueError, match="epsilon"):
            L.randomized_response([0, 1], 2, epsilon, rng)


@pytest.mark.parametrize("case", ["unary_flip_log_ratio", "grr channel's max_log_ratio"])
def test_randomized_response_audits_at_a_huge_epsilon_are_finite_or_refused(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    call = {"unary_flip_log_ratio": lambda: L.unary_flip_log_ratio(800.0, 3),
            "grr channel's max_log_ratio": lambda: L.max_log_ratio(L.grr_channel(800.0, 3))}[case]
    with np.errstate(all="ignore"):
        _refused_or_finite(call, "epsilon")


@pytest.mark.parametrize("bits", [[2, 2, 2], [0.5, 0.5]], ids=["2", "0.5"])
def test_flip_bits_refuses_values_that_are_not_bits(bits):
    from fedlab_nb.methods.beyond import locational_dp as L
    with pytest.raises(ValueError, match="bit"):
        L.flip_bits(bits, 1.0, np.random.default_rng(0))


def test_grr_probabilities_past_700_stay_a_distribution():  # held
    from fedlab_nb.methods.beyond import locational_dp as L
    for eps in (699.9, 700.1, 5000.0):
        p, q = L.grr_probabilities(eps, 4)
        assert np.isfinite([p, q]).all() and abs(p + 3 * q - 1) < 1e-12 and p >= q


# ================================================================================ (1) DP: other noise parameters
@pytest.mark.parametrize("noise", [float("inf"), True, "0.1"], ids=["inf", "True", "text"])
def test_norm_clipping_refuses_a_noise_that_is_not_a_finite_number(noise):
    from fedlab_nb.methods.robustness.backdoors import NormClipping
    with pytest.raises(ValueError, match="noise"):
        NormClipping(1.0, noise)


@pytest.mark.parametrize("q", ["0.05", True], ids=["text", "True"])
def test_lora_dp_method_refuses_a_sample_rate_that_is_not_a_number(q):
    from fedlab_nb.lora import add_lora
    from fedlab_nb.methods.privacy.fedsvd import lora_dp_method
    model = add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)), 2)
    with pytest.raises(ValueError, match="sample_rate"):
        lora_dp_method(model, sample_rate=q, noise_multiplier=1.0, clip_norm=1.0)


def test_gradient_inversion_clip_and_noise_refuses_text_and_inf():  # held
    from fedlab_nb.methods.privacy.gradient_inversion import clip_and_noise
    for clip, z in ((1.0, "1"), (float("inf"), 1.0), (1.0, float("inf")), (True, 1.0)):
        with pytest.raises(ValueError):
            clip_and_noise({"w": torch.ones(3)}, clip, z, torch.Generator())


def test_dp_resume_mid_run_gives_the_epsilon_of_the_uninterrupted_run(fed10, tmp_path):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler

    def stop(r, theta, row):
        if r == 2:
            raise KeyboardInterrupt
    base = dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1, accountant="pld")
    m0, s0 = dp_fedavg_with_sampler(fed10, **base)
    whole = fl.simulate(m0, fed10, rounds=5, clients_per_round=s0, seed=0, **RUN)
    m1, s1 = dp_fedavg_with_sampler(fed10, **base)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(m1, fed10, rounds=5, clients_per_round=s1, seed=0, checkpoint=tmp_path / "c.pt", callback=stop,
                    **RUN)
    m2, s2 = dp_fedavg_with_sampler(fed10, **base)
    resumed = fl.simulate(m2, fed10, rounds=5, clients_per_round=s2, seed=0, checkpoint=tmp_path / "c.pt",
                          resume=True, **RUN)
    assert np.allclose(resumed["epsilon"], whole["epsilon"]) and np.isfinite(resumed["epsilon"]).all()


def test_dp_on_a_conv_net_with_backend_auto_equals_the_loop(fed10):  # held (auto_backend: conv on CPU -> loop)
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    runs = []
    for backend in ("auto", "loop"):
        method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.2)
        h, seen = trace(method, fed10, sampler, 2, model="cnn", backend=backend)
        runs.append((h, seen))
    (ha, sa), (hl, sl) = runs
    assert all(torch.equal(a, b) for a, b in zip(sa, sl)) and np.allclose(ha["epsilon"], hl["epsilon"])


# ================================================================================ (7) publish: interrupts, links, disk
def _published(tmp_path):
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    for folder, text in ((tmp, "new"), (out, "old")):
        (folder / "tiny-smoke").mkdir(parents=True)
        (folder / "tiny-smoke" / f"{text}.png").write_text(text)
        (folder / "tiny-smoke.json").write_text(text)
    (tmp / "tiny-smoke.ipynb").write_text("new")
    return tmp, out


def _publish_then_drop_staging(tmp, out):
    """publish as runner.py calls it, inside `staging`, whose folder is removed on the way out."""
    import shutil

    from fedlab_nb.repro.files import publish
    try:
        publish(tmp, out, ["tiny-smoke", "tiny-smoke.ipynb", "tiny-smoke.json"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_an_interrupt_right_after_the_old_figures_are_set_aside_keeps_them(tmp_path, monkeypatch):
    tmp, out = _published(tmp_path)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        done = real(a, b)
        if len(calls) == 1:  # the signal arrives as the set-aside's rename returns
            raise KeyboardInterrupt
        return done
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _publish_then_drop_staging(tmp, out)
    monkeypatch.undo()
    figures = sorted(p.name for p in (out / "tiny-smoke").iterdir()) if (out / "tiny-smoke").is_dir() else None
    assert ((out / "tiny-smoke.json").read_text(), figures) in (("old", ["old.png"]), ("new", ["new.png"])), figures


def test_publish_never_writes_through_a_hard_link_at_the_result(tmp_path):  # held
    tmp, out = _published(tmp_path)
    os.link(out / "tiny-smoke.json", tmp_path / "elsewhere.json")
    _publish_then_drop_staging(tmp, out)
    assert (tmp_path / "elsewhere.json").read_text() == "old" and (out / "tiny-smoke.json").read_text() == "new"


@pytest.mark.parametrize("at", [2, 3], ids=["the notebook's move", "the result's move"])
def test_a_full_disk_part_way_through_publish_keeps_the_old_result(tmp_path, monkeypatch, at):  # held
    tmp, out = _published(tmp_path)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == at:
            raise OSError(errno.ENOSPC, "No space left on device", str(b))
        return real(a, b)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        _publish_then_drop_staging(tmp, out)
    monkeypatch.undo()
    assert (out / "tiny-smoke.json").read_text() == "old" and not (out / "tiny-smoke.ipynb").exists()
    assert sorted(p.name for p in (out / "tiny-smoke").iterdir()) == ["old.png"]


@pytest.mark.parametrize("case", ["a link named like a killed run", "a killed run holding a link"])
def test_staging_never_deletes_through_links_left_in_the_results(tmp_path, case):  # held
    from fedlab_nb.repro.files import staging
    victim, out = tmp_path / "victim", tmp_path / "out"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    out.mkdir()
    if case == "a link named like a killed run":
        (out / ".tiny-smoke.abc.running").symlink_to(victim, target_is_directory=True)
    else:
        (out / ".tiny-smoke.abc.running").mkdir()
        (out / ".tiny-smoke.abc.running" / "fig").symlink_to(victim, target_is_directory=True)
    with staging(out, "tiny-smoke"):
        pass
    assert (victim / "keep.txt").read_text() == "keep"


# ================================================================================ (2) paths: a tilde, sub-folders
@pytest.mark.parametrize("how", ["--results", "FEDLAB_NB_RESULTS"])
def test_a_results_path_starting_with_a_tilde_is_expanded_or_refused(tmp_path, monkeypatch, how):
    root = root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    args = ["--root", root, "report"]
    if how == "--results":
        args = ["--root", root, "--results", "~/res", "report"]
    else:
        monkeypatch.setenv("FEDLAB_NB_RESULTS", "~/res")
    rc, out, err = cli(args)
    assert not (tmp_path / "~").exists(), (rc, out, err)


def test_history_and_report_with_relative_paths_from_a_sub_folder(tmp_path, monkeypatch):  # held
    root = root_copy(tmp_path)
    (root / "sub").mkdir()
    (root / "sub" / "h.csv").write_text("round,test_acc\n1,0.5\n")
    monkeypatch.chdir(root / "sub")
    monkeypatch.setenv("FEDLAB_NB_RESULTS", "../res")
    rc, out, err = cli(["--root", "..", "history", "h.csv"])
    assert rc == 0 and "1 rounds" in out, (rc, out, err)
    rc, out, err = cli(["--root", "..", "report"])
    assert rc == 0 and (root / "res" / "REPORT.md").is_file(), (rc, out, err)


# ================================================================================ (7) OSError wording on reads
def test_a_read_error_in_history_gives_read_advice(tmp_path):
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "history", tmp_path / ("a" * 300 + ".csv")])
    one_line_error(rc, err)
    assert "--results" not in err and "results already written" not in err, err


@pytest.mark.parametrize("cmd", [["params", "tiny"], ["run", "tiny"], ["list"]])
def test_a_notebook_name_too_long_is_one_line_naming_the_field(tmp_path, cmd):  # held
    root = root_copy(tmp_path, lambda t: t.replace("notebooks/tiny.ipynb", "notebooks/" + "a" * 300 + ".ipynb"))
    rc, out, err = cli(["--root", root, *cmd])
    assert "notebook" in (out + err) and "Traceback" not in err and "raised" not in str(rc), (rc, err)


# ================================================================================ (8) History files: order, sidecars
@pytest.mark.parametrize("rows", ["1,0.5,1.0,1e-5\n2,0.6,5.0,1e-5\n1,0.6,1.0,1e-5\n",
                                  "1,0.5,1.0,1e-5\n2,0.6,5.0,1e-5\n2,0.6,0.5,1e-5\n"],
                         ids=["rounds out of order", "a round repeated with a smaller epsilon"])
def test_history_with_rows_out_of_order_states_no_smaller_guarantee(tmp_path, rows):
    (tmp_path / "h.csv").write_text("round,test_acc,epsilon,dp_delta\n" + rows)
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert "raised" not in str(rc) and "epsilon = 1," not in out and "epsilon = 0.5," not in out, (rc, out)


def test_history_prints_a_sidecar_full_of_escapes_clean(tmp_path):  # held
    (tmp_path / "h.csv").write_text("round,test_acc,epsilon,dp_delta\n1,0.5,1,1e-5\n")
    (tmp_path / "h.json").write_text(json.dumps({"method": "dp\x1b[2J\u202eevil", "dataset": "\x9bx",
                                                 "num_clients": "\x07", "seed": "\r\u2028"}))
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert rc == 0 and _clean(out + err), repr(out + err)


@pytest.mark.parametrize("sidecar", ["deep", "/dev/zero link", "non-UTF-8 CSV"])
def test_history_with_a_hostile_sidecar_or_csv_is_one_line(tmp_path, sidecar):  # held
    (tmp_path / "h.csv").write_text("round,test_acc\n1,0.5\n")
    if sidecar == "deep":
        (tmp_path / "h.json").write_text("[" * 100000 + "]" * 100000)
    elif sidecar == "/dev/zero link":
        (tmp_path / "h.json").symlink_to("/dev/zero")
    else:
        (tmp_path / "h.csv").write_bytes(b"round,acc\xff\xfe\n1,0.5\n")
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    one_line_error(rc, err)


# ================================================================================ (8) data fetch: a truncated archive
def _archive(path, members, cut=None):
    import io
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))
    if cut:
        path.write_bytes(path.read_bytes()[:cut(path.stat().st_size)])


def test_data_fetch_with_a_truncated_archive_is_one_line(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    info = tarfile.TarInfo("cifar-10-batches-py/a")
    info.size = 200000
    _archive(folder / "cifar-10-python.tar.gz", [(info, os.urandom(200000))], cut=lambda n: n // 2)
    rc, out, err = cli(["--root", root_copy(tmp_path), "data", "fetch", "cifar10", "--dir", folder])
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)


@pytest.mark.parametrize("case", ["a link out then a file through it", "a hard link to /etc/passwd", "a device"])
def test_data_fetch_with_a_hostile_archive_writes_nothing_outside(tmp_path, case):  # held
    folder, outside = tmp_path / "d", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    members = []
    if case == "a link out then a file through it":
        link = tarfile.TarInfo("lnk")
        link.type, link.linkname = tarfile.SYMTYPE, str(outside)
        evil = tarfile.TarInfo("lnk/evil")
        evil.size = 1
        members = [(link, None), (evil, b"x")]
    elif case == "a hard link to /etc/passwd":
        link = tarfile.TarInfo("passwd")
        link.type, link.linkname = tarfile.LNKTYPE, "/etc/passwd"
        members = [(link, None)]
    else:
        dev = tarfile.TarInfo("null")
        dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
        members = [(dev, None)]
    _archive(folder / "cifar-10-python.tar.gz", members)
    rc, out, err = cli(["--root", root_copy(tmp_path), "data", "fetch", "cifar10", "--dir", folder])
    assert not any(outside.iterdir()) and not (folder / "passwd").exists()
    assert "raised" not in str(rc) and "Traceback" not in err, (rc, err)


# ================================================================================ (4)/(8) claims files deep or wide
@pytest.mark.parametrize("text", ["x: " + "[" * 5000 + "]" * 5000, "x: " + "{a: " * 3000 + "1" + "}" * 3000,
                                  "x: {" + ", ".join(f"k{i}: {i}" for i in range(15000)) + "}",
                                  "x: [" + ", ".join(["1"] * 20001) + "]"],
                         ids=["5000 lists deep", "3000 mappings deep", "15000 keys", "20001 values"])
def test_a_deep_or_wide_claims_file_is_one_invalid_line_and_others_still_list(tmp_path, text):  # held
    root = root_copy(tmp_path)
    (root / "papers" / "wide.yaml").write_text("id: wide\n" + text + "\n")
    rc, out, err = cli(["--root", root, "list"])
    _no_traceback(rc, err)
    assert "wide: INVALID" in out + err and "tiny —" in out, (out + err)[:300]


@pytest.mark.parametrize("cmd", [["run"], ["params"], ["figures", "check"], ["reproduce"], ["history"]])
def test_a_paper_id_full_of_escapes_is_never_echoed_raw(tmp_path, cmd):  # held
    rc, out, err = cli(["--root", root_copy(tmp_path), *cmd, "ti\x1b[2J\u202eny\x07"])
    assert "raised" not in str(rc) and _clean(out + err), repr(err)


# ================================================================================ (8) figures: a claims file's NaN
@pytest.mark.parametrize("value", [".nan", "-.inf"])
def test_figures_update_with_a_non_finite_smoke_parameter_is_one_line(tmp_path, value):
    root = root_copy(tmp_path, lambda t: t.replace("parameters: {n_points: 4}", f"parameters: {{n_points: {value}}}"))
    data = tmp_path / "from"
    data.mkdir()
    (data / "main.data.json").write_text(json.dumps({"series": [{"key": "k", "values": [1.0, 2.0]}]}))
    rc, out, err = cli(["--root", root, "figures", "update", "tiny", "--from", data])
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)


def test_figures_update_prints_figure_names_and_keys_clean(tmp_path):  # held
    root = root_copy(tmp_path)
    data = tmp_path / "from"
    data.mkdir()
    (data / "m\x1b[2J\u202e.data.json").write_text(json.dumps({"series": [{"key": "k\x1b]0;x\x07",
                                                                          "values": [1.0]}]}))
    rc, out, err = cli(["--root", root, "figures", "update", "tiny", "--from", data])
    assert rc == 0 and _clean(out + err), repr(out + err)
    assert (root / "papers" / "figures" / "tiny.json").is_file()


def test_figures_update_never_writes_through_papers_linked_out(tmp_path):  # held
    root, outside = root_copy(tmp_path), tmp_path / "outside"
    outside.mkdir()
    (root / "papers" / "figures").symlink_to(outside, target_is_directory=True)
    data = tmp_path / "from"
    data.mkdir()
    (data / "main.data.json").write_text(json.dumps({"series": [{"key": "k", "values": [1.0]}]}))
    rc, out, err = cli(["--root", root, "figures", "update", "tiny", "--from", data])
    assert not any(outside.iterdir()), (rc, err)
    one_line_error(rc, err)


# ================================================================================ (3) lab and the board: links
@pytest.mark.parametrize("case", ["lab/student a link out", "lab a link out"])
def test_lab_refuses_its_folders_linked_out(tmp_path, case):  # held
    root, outside = root_copy(tmp_path), tmp_path / "outside"
    outside.mkdir()
    (root / "results" / "lab").mkdir(parents=True)
    if case == "lab/student a link out":
        (root / "results" / "lab" / "student").symlink_to(outside, target_is_directory=True)
        args = ["lab", "--student", "--dry-run"]
    else:
        (root / "results" / "lab").rmdir()
        (root / "results" / "lab").symlink_to(outside, target_is_directory=True)
        args = ["lab", "--dry-run"]
    rc, out, err = cli(["--root", root, *args])
    assert not any(outside.iterdir())
    one_line_error(rc, err)


@pytest.mark.parametrize("name", ["lab/tiny.ipynb", "REPORT.md", "index.html"])
def test_a_hard_link_in_results_is_replaced_never_written_through(tmp_path, name):  # held
    root = root_copy(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (root / "results" / "lab").mkdir(parents=True)
    os.link(victim, root / "results" / name)
    cmd = ["lab", "--fresh", "--dry-run"] if name.startswith("lab") else ["report"]
    rc, out, err = cli(["--root", root, *cmd])
    assert victim.read_text() == "keep", (rc, err)


# ================================================================================ (4) -p values and run folders
@pytest.mark.parametrize("text,value", [("0x1A", 26), ("0o17", 15), ("1_000", "1_000"), ("-0x10", "-0x10"),
                                        ("+.5", 0.5), ("5.", 5.0), ("1:20", "1:20"), ("!!python/name:os.system",
                                                                                    "!!python/name:os.system")])
def test_p_values_follow_yaml_1_2(text, value):  # held
    from fedlab_nb.cli import _parse_parameters
    got = _parse_parameters([("value", text)])["value"]
    assert got == value and type(got) is type(value), got


@pytest.mark.parametrize("text", ["!!float .inf", "!!float 1e999", "[!!float nan]", "{a: !!float -.inf}"])
def test_p_values_tagged_not_finite_are_refused_before_a_kernel(tmp_path, text):  # held
    root = root_copy(tmp_path)
    rc, out, err = cli(["--root", root, "run", "tiny", "-p", "value", text])
    one_line_error(rc, err)
    assert not (root / "results" / "runs").exists() or not any((root / "results" / "runs").iterdir())


@pytest.mark.parametrize("value", ["../../x", "/etc/passwd", "a\x00b", "\x1b[2J", "..", "." * 300, "a/" * 200])
def test_run_folder_names_from_values_stay_one_folder_under_runs(tmp_path, value):  # held
    from fedlab_nb.repro.runner import run_folder
    path = run_folder("tiny", "smoke", {"value": value}, tmp_path)
    assert path.parent == tmp_path / "runs" and len(path.name) < 255 and _clean(path.name), path
    assert "/" not in path.name and "\x00" not in path.name and path.name not in (".", "..")


# ================================================================================ (6) secure aggregation's fixed point
def test_secure_aggregation_refuses_a_quantisation_that_rounds_everything_to_zero():
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    with pytest.raises(ValueError, match="clip|scale"):
        FixedPoint(clip=1e-6)


@pytest.mark.parametrize("kw", [dict(clip=float("nan")), dict(scale=float("inf")), dict(bits=65), dict(bits=True),
                                dict(clip=True), dict(scale="1")])
def test_secure_aggregation_fixed_point_refuses_bad_settings(kw):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    with pytest.raises(ValueError):
        FixedPoint(**kw)


def test_secure_aggregation_capacity_is_checked_for_a_huge_scale():  # held
    from fedlab_nb.methods.privacy.secure_aggregation import FixedPoint
    with pytest.raises(ValueError, match="bits"):
        FixedPoint(clip=1.0, scale=2.0 ** 30, bits=32).check_capacity(10)


# ================================================================================ (new code) label DP: numpy draws
def test_label_dp_numpy_draws_that_overflow_the_size_check_are_named():
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    bags = A.random_bags(20, 4, rng)
    with np.errstate(all="ignore"), pytest.raises(ValueError, match="draws"):
        A.dp_bag_responses(rng.normal(size=20), bags, 1.0, 1.0, rng, draws=np.int64(2 ** 63 // len(bags) + 1))


# ================================================================================ (5) printable: \xNN ambiguity
def test_printable_tells_a_non_utf8_byte_from_its_escape_written_out():
    from fedlab_nb.repro.results import printable
    assert printable(os.fsdecode(b"tiny-sm\xffoke.json")) != printable("tiny-sm\\xffoke.json")
    names = [os.fsdecode(b) for b in (b"a\xff", b"a\\xff", b"a\\\xff", b"a\\\\xff", b"a\\\\\xff", b"a\\x", b"a\\\\x")]
    assert len({printable(n) for n in names}) == len(names), [printable(n) for n in names]  # one name, one print
    assert printable("a \\shorten $\\ell_2$") == "a \\shorten $\\ell_2$"  # LaTeX in a claim prints as it was


@pytest.mark.parametrize("text", ["a\u2029b", "a\u180eb", "a\U000e0041b", "a\u00adb", "a\ud800b", "a\x7fb"],
                         ids=["paragraph separator", "mongolian vowel separator", "tag A", "soft hyphen",
                              "lone surrogate", "DEL"])
def test_printable_drops_other_invisible_and_format_characters(text):  # held
    from fedlab_nb.repro.results import printable
    assert printable(text) in ("ab", "a b"), repr(printable(text))


# ================================================================================ (8) stale results of unknown scales
def test_a_stale_result_of_an_unknown_scale_gets_a_fix_that_works(tmp_path):
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    (root / "results" / "tiny-big.json").write_text("{")
    rc, out, err = cli(["--root", root, "list"])
    assert rc == 0 and "tiny-big.json" in err, (rc, err)
    assert "--scale big replaces it" not in err, err


@pytest.mark.parametrize("claim", [{"id": {"a": 1}, "verdict": "reproduced", "expect": 5, "role": ["headline"]},
                                   {"id": "x" * 5000, "verdict": None, "expect": "> 0"}, 1, None, "x"],
                         ids=["id a mapping", "a 5000-character id", "a number", "null", "text"])
@pytest.mark.parametrize("cmd", [["list"], ["report"]])
def test_result_claims_of_the_wrong_type_are_stale_not_fatal(tmp_path, claim, cmd):  # held
    root = root_copy(tmp_path)
    (root / "results").mkdir()
    (root / "results" / "tiny-smoke.json").write_text(json.dumps({**RESULT, "claims": [claim]}))
    rc, out, err = cli(["--root", root, *cmd])
    _no_traceback(rc, err)
    assert len(err.strip().splitlines()) <= 1 and ("stale" in out + err or "stale" in
                                                   (root / "results" / "REPORT.md").read_text()), (out, err)


# ================================================================================ (8) History twins, (6) Flower replies
@pytest.mark.parametrize("second", ["run.Csv", "run", "run.CSV"])
def test_history_twins_of_any_case_keep_their_own_metadata(tmp_path, fed10, second):  # held
    h1 = fl.simulate("fedavg", fed10, rounds=1, clients_per_round=2, seed=0, **RUN)
    h2 = fl.simulate("fedprox", fed10, rounds=1, clients_per_round=2, seed=0, **RUN)
    h1.save(tmp_path / "run.csv")
    try:
        h2.save(tmp_path / second)
    except ValueError:
        pass
    assert json.loads((tmp_path / "run.json").read_text())["method"] == "fedavg"


@pytest.mark.parametrize("field", ["delta inf", "train-loss nan", "train-loss -inf"])
def test_flower_non_finite_replies_are_refused_naming_the_client(fed10, field):  # held
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    bad = {"delta inf": dict(delta=np.full(s.theta.numel(), np.inf, np.float32)),
           "train-loss nan": {"train-loss": float("nan")}, "train-loss -inf": {"train-loss": float("-inf")}}[field]
    replies = [flower_reply(s, k, **(bad if k == 2 else {})) for k in range(3)]
    with pytest.raises(ValueError, match="client 2"):
        s.aggregate_train(1, replies)


# ================================================================================ (1) DP: a custom sampler, short runs
def test_dp_with_a_custom_sampler_never_reports_an_epsilon_below_what_it_released(fed10):
    from fedlab_nb.methods.privacy import accounting
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg
    method = dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    try:
        h = fl.simulate(method, fed10, rounds=4, clients_per_round=lambda r, k, g: np.arange(5), seed=0, **RUN)
    except ValueError as e:
        assert "sampl" in str(e)
        return
    assert h["epsilon"].iloc[-1] >= accounting.epsilon(1.0, 1.0, 4, 1e-5), h["epsilon"].tolist()


def test_dp_with_a_bernoulli_sampler_of_another_rate_is_refused_before_round_one(fed10):  # held
    from fedlab_nb.methods.privacy.dp import dp_sampler
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg
    seen = []
    with pytest.raises(ValueError, match="would not hold"):
        fl.simulate(dp_fedavg(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1), fed10, rounds=2,
                    clients_per_round=dp_sampler(0.5, 10), seed=0, callback=lambda *a: seen.append(1), **RUN)
    assert not seen


# ================================================================================ (2) a relative FEDLAB_NB_ROOT
@pytest.mark.parametrize("cmd", [["list"], ["params", "tiny"], ["report"]])
def test_a_relative_root_from_the_environment_from_a_sub_folder(tmp_path, monkeypatch, cmd):  # held
    root = root_copy(tmp_path)
    (root / "sub").mkdir()
    monkeypatch.chdir(root / "sub")
    monkeypatch.setenv("FEDLAB_NB_ROOT", "..")
    monkeypatch.delenv("FEDLAB_NB_RESULTS", raising=False)
    rc, out, err = cli(cmd)
    assert rc == 0 and ("tiny" in out or "wrote" in out), (rc, out, err)
    assert not (root / "sub" / "results").exists()


@pytest.mark.parametrize("change", [dict(noise_multiplier=3.0), dict(clip_norm=5.0), dict(sampling_rate=0.05)])
def test_dp_resume_with_other_privacy_settings_is_refused(fed10, tmp_path, change):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    base = dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.2)
    interrupted_dp_run(fed10, tmp_path / "c.pt", **base)
    m2, s2 = dp_fedavg_with_sampler(fed10, **{**base, **change})
    with pytest.raises(ValueError, match="checkpoint"):
        fl.simulate(m2, fed10, rounds=4, clients_per_round=s2, seed=0, checkpoint=tmp_path / "c.pt", resume=True,
                    **RUN)


# ================================================================================ (5) the board: quotes and markdown
def test_the_board_keeps_quotes_and_markdown_from_a_claim_text_inert(tmp_path):  # held
    root = root_copy(tmp_path)
    text = "ok' onmouseover='alert(1)' x=' | cell\n\n# FAKE\n[c](javascript:alert(1)) <img src=x onerror=alert(1)>"
    claim = {**RESULT["claims"][0], "text": text}
    (root / "results").mkdir()
    (root / "results" / "tiny-smoke.json").write_text(json.dumps({**RESULT, "claims": [claim]}))
    rc, out, err = cli(["--root", root, "report"])
    assert rc == 0, err
    html = (root / "results" / "index.html").read_text()
    md = (root / "results" / "REPORT.md").read_text()
    assert "onmouseover='" not in html and "<img" not in html and "<img" not in md and "\n# FAKE" not in md


# ================================================================================ (6) the server's stages out of order
@pytest.mark.parametrize("stage", ["collect_shares", "collect_masked", "unmask"])
def test_secagg_server_stage_before_its_time_aborts(stage):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort, SecAggParams, SecAggServer
    server = SecAggServer(SecAggParams(2, 4, 32), [1, 2, 3])
    with pytest.raises(SecAggAbort):
        getattr(server, stage)({1: b"\0" * 16, 2: b"\0" * 16})


# ================================================================================ (2)/(7) a real run: exit status
MISSING = ("  - id: missing_metric\n    role: supporting\n    text: \"never recorded\"\n    metric: no_such_metric\n"
           "    expect: \"> 0\"\n    verdict: reproduced\n")


def test_reproduce_with_a_relative_dotted_results_exits_1_when_a_claim_errors(tmp_path, monkeypatch):  # held (notebook)
    root = root_copy(tmp_path, lambda t: t + MISSING)
    monkeypatch.chdir(root)
    rc, out, err = cli(["--root", ".", "--results", "./gone/../res", "reproduce", "tiny", "-j", "1"])
    assert rc == 1 and "missing_metric: error" in out + err, (rc, out[-500:], err[-500:])
    assert (root / "res" / "tiny-smoke.json").is_file()


# ================================================================================ out of class: data files unpickled
class _Planted:
    """A pickle that, when loaded, writes a file (a stand-in for any code)."""
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (_touch, (self.path,))


def _touch(path):
    with open(path, "w") as f:
        f.write("ran")
    return {b"data": np.zeros((1, 3072)), b"labels": [0]}


def test_loading_cifar10_never_runs_code_from_the_data_folder(tmp_path):
    import pickle

    from fedlab_nb.data.datasets import load_cifar10
    folder, marker = tmp_path / "cifar-10-batches-py", tmp_path / "ran.txt"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps(_Planted(marker)))
    try:
        load_cifar10(str(folder))
    except Exception:  # noqa: BLE001 -- refusing the file is correct; running it is the finding
        pass
    assert not marker.exists()


# ================================================================================ (new code) the loss check's rows
def test_an_ignored_class_only_in_the_clients_data_is_refused_or_trains_alike_on_every_backend():
    import torch.nn.functional as F

    from fedlab_nb.data.federated import FederatedDataset

    def ignoring(outputs, y, reduction="mean"):
        return F.cross_entropy(outputs, y, ignore_index=0, reduction=reduction)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 5)).astype(np.float32), 1 + rng.integers(0, 2, 60)  # the test set: classes 1, 2
    clients = [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(3)]
    fed = FederatedDataset.from_clients(clients, test=(x, y))
    thetas = {}
    for backend in ("loop", "vmap"):
        seen = []
        try:
            fl.simulate("fedavg", fed, "logreg", loss=ignoring, rounds=1, batch_size=8, progress=False, seed=0,
                        backend=backend, callback=lambda r, theta, row: seen.append(theta.clone()))
        except ValueError:
            return  # refused: correct
        thetas[backend] = seen[-1]
    gap = float((thetas["loop"] - thetas["vmap"]).abs().max())
    assert gap < 1e-5, gap


def test_a_second_run_lock_of_one_paper_in_one_process_is_refused(tmp_path):  # held
    from fedlab_nb.repro.files import RunLockedError, run_lock
    with run_lock(tmp_path, "tiny", "smoke"):
        with pytest.raises(RunLockedError, match="another run of tiny"):
            with run_lock(tmp_path, "tiny", "paper"):
                pass
    with run_lock(tmp_path, "tiny", "smoke"):  # released on the way out
        pass


# ================================================================================ (7) History.save stopped part-way
@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["interrupt", "disk full"])
def test_history_save_stopped_between_its_files_never_pairs_new_rows_with_old_metadata(tmp_path, fed10,
                                                                                       monkeypatch, stop):
    from fedlab_nb.core import history as H
    old = fl.simulate("fedavg", fed10, rounds=1, clients_per_round=2, seed=0, **RUN)
    new = fl.simulate("fedprox", fed10, rounds=2, clients_per_round=2, seed=0, **RUN)
    old.save(tmp_path / "run.csv")
    real, calls = H._write_atomic, []

    def write(path, text):
        calls.append(path)
        if len(calls) == 2:  # the metadata's write, after the rows'
            raise stop
        return real(path, text)
    monkeypatch.setattr(H, "_write_atomic", write)
    with pytest.raises(stop if isinstance(stop, type) else type(stop)):
        new.save(tmp_path / "run.csv")
    monkeypatch.undo()
    back = H.History.load(tmp_path / "run.csv")
    assert (len(back), back.meta.get("method")) in ((1, "fedavg"), (2, "fedprox")), (len(back), back.meta.get("method"))


def test_history_save_never_writes_through_a_hard_link(tmp_path, fed10):  # held
    victim = tmp_path / "victim.csv"
    victim.write_text("keep")
    os.link(victim, tmp_path / "run.csv")
    fl.simulate("fedavg", fed10, rounds=1, clients_per_round=2, seed=0, **RUN).save(tmp_path / "run.csv")
    assert victim.read_text() == "keep"


def test_publish_on_a_file_system_without_hard_links_still_replaces_and_rolls_back(tmp_path, monkeypatch):
    """Where os.link is refused (FAT, some network shares), publish keeps the old file by copying it: the new result
    is published, and an interrupt part-way still puts the old one back."""
    from fedlab_nb.repro.files import publish

    def no_links(*_):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    for interrupt in (False, True):
        tmp, out = tmp_path / f"s{interrupt}", tmp_path / f"o{interrupt}"
        for folder, text in ((tmp, "new"), (out, "old")):
            (folder / "tiny-smoke").mkdir(parents=True)
            (folder / "tiny-smoke" / f"{text}.png").write_text(text)
            (folder / "tiny-smoke.json").write_text(text)
        if interrupt:
            real = os.replace

            def replace(a, b, new_json=tmp / "tiny-smoke.json"):
                if Path(a) == new_json:  # the result file's move, after the figures folder's
                    raise KeyboardInterrupt
                return real(a, b)
            monkeypatch.setattr(os, "replace", replace)
            with pytest.raises(KeyboardInterrupt):
                publish(tmp, out, ["tiny-smoke", "tiny-smoke.json"])
            monkeypatch.setattr(os, "replace", real)
        else:
            publish(tmp, out, ["tiny-smoke", "tiny-smoke.json"])
        want = "old" if interrupt else "new"
        assert (out / "tiny-smoke.json").read_text() == want
        assert [p.name for p in (out / "tiny-smoke").iterdir()] == [f"{want}.png"]
