"""Probe 42m: a thirteenth, independent re-run of issue 42's failure classes, aimed first at what is new since the
twelfth (label-DP bag responses' type and size checks, History's metadata name, history's privacy line, the
expectation's text arithmetic, the write-error advice, paper_scale.py store's folder checks, the loss check's rows)
and at variants the earlier test_probe42*.py do not try: the package's other DP mechanisms (locational_dp,
dp_robust, FedSVD's DP-SGD, cpa) and the accountant against every History row, NUL bytes in paths from files,
symbolic-link loops, lock files of hostile size and shape, a notebook error full of control characters, HTML in
every result field, publish stopped part-way, data fetch's archive, other errno values and a claims file at the
size limit. Each test asserts the correct behaviour; a test marked xfail(strict=True) is an open finding (its
reason says what is wrong), so the suite stays green until it is fixed."""
import json
import os

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from probes import KW as RUN
from probes import REPO, cli, fed10, one_line_error, root_copy, script, trace  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_  # noqa: F401 (a new finding is marked with it)
from probes import (  # noqa: F401 (shared by the probe files)
    CONTROL, PNG, RESULT, clean as _clean, no_traceback as _no_traceback, interrupted_dp_run)


def _results(tmp_path, **files):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    for name, text in files.items():
        (results / name).write_text(text, encoding="utf-8")
    return root, results


# ================================================================================ (1) DP: other variants
@pytest.mark.parametrize("kw", [dict(estimator="clipped", example_cap=50.0, accountant="pld"),
                                dict(estimator="clipped", adaptive=True, clip_count_stddev=1.0)],
                         ids=["clipped, capped weights, PLD", "clipped, adaptive clip"])
def test_dp_clipped_estimator_variants_noise_every_empty_round(fed10, kw):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1, **kw)
    h, seen = trace(method, fed10, sampler, 6)
    assert (h["n_sampled"] == 0).any()  # the variant reaches an empty round
    assert all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1])) and np.isfinite(h["epsilon"]).all()


def test_local_dp_with_poisson_sampling_reports_a_finite_epsilon_in_every_row(fed10):  # held
    from fedlab_nb.methods.privacy.dp import dp_sampler
    from fedlab_nb.methods.privacy.dp_fedavg import local_dp_fedavg
    h, seen = trace(local_dp_fedavg(noise_multiplier=1.0, clip_norm=0.5), fed10, dp_sampler(0.05, 10), 6)
    assert (h["n_sampled"] == 0).any() and np.isfinite(h["epsilon"]).all() and (np.diff(h["epsilon"]) >= 0).all()


def test_dp_resume_that_asks_for_more_rounds_is_refused_or_accounts_every_round(fed10, tmp_path):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    base = dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    interrupted_dp_run(fed10, tmp_path / "c.pt", **base)
    m2, s2 = dp_fedavg_with_sampler(fed10, **base)
    try:
        h = fl.simulate(m2, fed10, rounds=6, clients_per_round=s2, seed=0, checkpoint=tmp_path / "c.pt", resume=True,
                        **RUN)
    except ValueError as e:
        assert "checkpoint" in str(e)
        return
    assert list(h["round"]) == list(range(1, 7)) and np.isfinite(h["epsilon"]).all()


# ================================================================================ (new code) label DP: types and sizes
@pytest.mark.parametrize("kw", [dict(epsilon="1"), dict(clip="1"), dict(epsilon=None), dict(epsilon=True),
                                dict(clip=True)], ids=["epsilon text", "clip text", "epsilon None", "epsilon True",
                                                       "clip True"])
def test_label_dp_bag_responses_refuse_privacy_parameters_of_the_wrong_type(kw):
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    args = {"epsilon": 1.0, "clip": 1.0, **kw}
    with pytest.raises(ValueError, match="epsilon|clip"):
        A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng), rng=rng, **args)


def test_label_dp_bag_responses_with_a_subnormal_epsilon_is_refused_or_finite():
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    try:
        out = A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng), 1e-320, 1.0, rng)
    except ValueError:
        return
    assert np.isfinite(out).all(), out


def test_label_dp_bag_responses_with_an_absurd_number_of_draws_is_a_named_error():
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="draws"):
        A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng), 1.0, 1.0, rng, draws=2 ** 40)


@pytest.mark.parametrize("y", [np.array([True, False] * 10), np.arange(20, dtype=np.uint8), np.full(20, np.inf),
                               np.full(20, 1e308)], ids=["bool", "uint8", "inf", "1e308"])
def test_label_dp_bag_responses_with_odd_real_responses_release_finite_means(y):  # held
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    assert np.isfinite(A.dp_bag_responses(y, A.random_bags(20, 4, rng), 1.0, 1.0, rng)).all()


# ========================================================================= (new code) History metadata and summary
def test_history_saves_to_a_name_and_its_csv_keep_their_own_metadata(tmp_path):
    fed = fl.federate("digits", "iid", n_clients=3, seed=0)
    a = fl.simulate("fedavg", fed, "logreg", rounds=1, lr=0.1, progress=False)
    b = fl.simulate("fedprox", fed, "logreg", rounds=1, lr=0.05, progress=False)
    a.save(tmp_path / "run")
    try:
        b.save(tmp_path / "run.csv")
    except ValueError:
        return  # refused, naming the clash: fine
    assert fl.History.load(tmp_path / "run").meta.get("method") == a.meta.get("method")


def test_history_save_refuses_a_link_at_a_dotted_names_metadata(tmp_path):  # held
    h = fl.simulate("fedavg", fl.federate("digits", "iid", n_clients=3, seed=0), "logreg", rounds=1, progress=False)
    (tmp_path / "victim.txt").write_text("keep")
    (tmp_path / "run_lr0.1.json").symlink_to(tmp_path / "victim.txt")
    with pytest.raises(ValueError, match="link"):
        h.save(tmp_path / "run_lr0.1")
    assert (tmp_path / "victim.txt").read_text() == "keep" and not (tmp_path / "run_lr0.1").exists()


@pytest.mark.parametrize("delta", ["5", "-1"])
def test_history_does_not_report_an_invalid_delta_as_a_guarantee(tmp_path, delta):
    (tmp_path / "h.csv").write_text(f"round,test_acc,epsilon,dp_delta\n1,0.5,1,1e-5\n2,0.6,2,{delta}\n")
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert "raised" not in str(rc) and f"delta = {delta}" not in out, (rc, out)


def test_history_does_not_report_an_earlier_epsilon_as_the_final_one(tmp_path):
    (tmp_path / "h.csv").write_text("round,test_acc,epsilon,dp_delta\n1,0.5,1,1e-5\n2,0.6,,1e-5\n")
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert "raised" not in str(rc) and "epsilon = 1," not in out, (rc, out)


# ================================================================================ (2) relative paths
@pytest.mark.parametrize("results", ["res/", "./res//", "res/."], ids=["trailing slash", "dot and slashes", "dot"])
def test_report_with_a_relative_results_of_odd_spelling(tmp_path, monkeypatch, results):  # held
    root = root_copy(tmp_path)
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "tiny-smoke.json").write_text(json.dumps(RESULT))
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(["--root", "root", "report", "--results", results])
    assert rc == 0 and (tmp_path / "res" / "REPORT.md").is_file(), (rc, err)
    assert not (root / "results").exists()


def test_data_and_params_with_a_relative_root_from_a_sub_folder(tmp_path, monkeypatch):  # held
    root_copy(tmp_path)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    for cmd in (["data"], ["params", "tiny"]):
        rc, out, err = cli(["--root", "../root", *cmd])
        assert rc == 0 and "Traceback" not in err, (cmd, rc, err)


# ================================================================================ (3) link loops
@pytest.mark.parametrize("cmd", [["report"], ["run", "tiny"], ["reproduce", "tiny", "-j", "1"], ["lab", "--dry-run"]])
def test_a_results_folder_that_is_a_link_loop_is_one_line(tmp_path, cmd):  # held
    root = root_copy(tmp_path)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "a", *cmd])
    one_line_error(rc, err)


@pytest.mark.parametrize("cmd", [["report"], ["run", "tiny"]])
def test_a_results_folder_under_a_link_loop_is_one_line(tmp_path, cmd):  # held
    root = root_copy(tmp_path)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "a" / "res", *cmd])
    one_line_error(rc, err)


def _to_store(tmp_path):
    root, results = root_copy(tmp_path), tmp_path / "results"
    (results / "tiny-paper").mkdir(parents=True)
    (results / "tiny-paper" / "main.png").write_bytes(PNG)
    result = {**RESULT, "scale": "paper", "error": None, "figures": ["tiny-paper/main.png"], "figure_data": []}
    (results / "tiny-paper.json").write_text(json.dumps(result))
    return root, results


@pytest.mark.parametrize("case", ["store a dangling link", "figures folder a link loop"])
def test_store_refuses_dangling_and_looping_links_in_papers(tmp_path, case):  # held
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _to_store(tmp_path)
    if case == "store a dangling link":
        (root / "papers" / "paper_scale").symlink_to(tmp_path / "nowhere")
    else:
        (root / "papers" / "paper_scale").mkdir()
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        (root / "papers" / "paper_scale" / "tiny").symlink_to(tmp_path / "loop")
    with pytest.raises(SystemExit) as e:
        module.store("tiny", results, root)
    assert "link" in str(e.value.code) and not (tmp_path / "nowhere").exists()


# ================================================================================ (4) NUL bytes in paths from files
@pytest.mark.parametrize("cmd", [["list"], ["params", "tiny"], ["run", "tiny"]])
def test_a_notebook_field_with_a_nul_byte_is_one_line(tmp_path, cmd):  # held
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb",
                                                   'notebook: "notebooks/tiny.ipynb\\0x"'))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
    assert "Traceback" not in err and "raised" not in str(rc) and "\0" not in out + err, (rc, err)
    assert "notebook" in out + err


@pytest.mark.parametrize("cmd", [["list"], ["report"]])
def test_result_paths_with_a_nul_byte_are_not_a_crash(tmp_path, cmd):  # held
    result = {**RESULT, "figures": ["tiny-smoke/a\u0000.png"], "figure_data": ["x\u0000"], "notebook": "a\u0000",
              "outputs": ["a\u0000b"]}
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(result)})
    rc, out, err = cli(["--root", root, "--results", results, *cmd])
    _no_traceback(rc, err)


# ================================================================================ (4)/(new code) expectations
def test_an_expectation_cannot_repeat_a_list_by_a_metric():
    from fedlab_nb.repro.expect import MetricError, parse_expectation
    with pytest.raises(MetricError):
        parse_expectation("== n * m").holds(1.0, {"n": [0], "m": 10 ** 17})


@pytest.mark.parametrize("text,metrics", [('> "abc"', {}), ('between "a" and "b"', {}), ("> n", {"n": "abc"}),
                                          ("> n", {"n": {"a": 1}}), ("within 0.1 of n", {"n": "x"})],
                         ids=["above text", "between texts", "above a text metric", "above a mapping",
                              "within of text"])
def test_expectations_comparing_numbers_with_text_are_metric_errors(text, metrics):  # held
    from fedlab_nb.repro.expect import MetricError, parse_expectation
    try:
        expect = parse_expectation(text)
    except ValueError:
        return  # refused when read: fine
    with pytest.raises(MetricError):
        expect.holds(1.0, metrics)


# ================================================================================ (5) a notebook error's text
def test_a_notebook_error_full_of_control_characters_is_printed_clean(tmp_path):  # held (runs the tiny notebook)
    root = root_copy(tmp_path)
    path = root / "notebooks" / "tiny.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"][2]["source"] = 'raise RuntimeError("bad\\x1b]0;pwned\\x07 \\u202e\\x9b31m \\r\\n second line")'
    path.write_text(json.dumps(nb))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "reproduce", "tiny", "-j", "1"])
    assert rc == 1 and "pwned" in err and _clean(out + err), (rc, repr(out + err))
    for cmd in (["list"], ["report"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
        assert rc == 0 and _clean(out + err), (cmd, repr(out + err))
    for name in ("REPORT.md", "index.html"):
        assert _clean((tmp_path / "res" / name).read_text()), name


# ================================================================================ (6) Flower and secure aggregation
@pytest.mark.parametrize("delta", [np.full((650, 1), 0.01, np.float32), np.full(650, 0.01, np.float16),
                                   np.zeros(0, np.float32)], ids=["a column", "float16", "empty"])
def test_flower_reply_deltas_of_odd_shape_or_dtype_are_refused_naming_the_client(fed10, delta):  # held
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    assert s.theta.numel() == 650
    before = s.theta.clone()
    with pytest.raises(ValueError, match="client 0"):
        s.aggregate_train(1, [flower_reply(s, 0, delta), flower_reply(s, 1)])
    assert torch.equal(s.theta, before)


@pytest.mark.parametrize("sizes", [np.array([20.5, 20, 20]), np.array([2 ** 62, 20, 20])], ids=["fraction", "2^62"])
def test_secagg_client_sizes_as_numpy_arrays_are_checked(sizes):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import with_secure_aggregation
    fed = fl.federate("digits", "iid", n_clients=3, seed=0)
    with pytest.raises(ValueError, match="client_sizes|bits"):
        method = with_secure_aggregation(fl.get_method("fedavg"), client_sizes=sizes)
        fl.simulate(method, fed, "logreg", rounds=1, progress=False, seed=0)


# ================================================================================ (7) other write errors
def _failing_writes(monkeypatch, number):
    import tempfile

    def fail(*a, **k):
        raise OSError(number, os.strerror(number))
    monkeypatch.setattr(tempfile, "mkstemp", fail)


def test_a_permission_error_without_eacces_is_one_line(tmp_path, monkeypatch):  # held (EPERM: chattr +i, a mount)
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    _failing_writes(monkeypatch, 1)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    one_line_error(rc, err)


@pytest.mark.parametrize("number", [27, 116, 24], ids=["EFBIG", "ESTALE", "EMFILE"])
def test_other_write_errors_are_one_line(tmp_path, monkeypatch, number):
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    _failing_writes(monkeypatch, number)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)


# ================================================================================ (7)/(8) lock files of hostile shape
@pytest.mark.parametrize("data", [b"[" * 100000 + b"]" * 100000, b"\xff\xfe{\x00", b"[1, 2]",
                                  b'{"pid": ' + b"9" * 5000 + b"}", b'{"host": "' + b"a" * (20 << 20) + b'"}'],
                         ids=["deep", "non-UTF-8", "a list", "a 5000-digit pid", "20 MB"])
def test_a_held_lock_of_hostile_shape_is_one_short_line(tmp_path, data):  # held
    import subprocess
    import sys
    root, results = _results(tmp_path)
    (results / "tiny.lock").write_bytes(data)
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(results / "tiny.lock")], stdout=subprocess.PIPE)
    holder.stdout.readline()
    try:
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "-j", "1"])
    finally:
        holder.kill()
        holder.wait()
    assert rc == 1 and "another run" in out + err and len(out + err) < 2000, (rc, (out + err)[:300])
    assert (results / "tiny.lock").read_bytes()[:20] == data[:20]


# ================================================================================ (8) checkpoints of odd content
@pytest.mark.parametrize("data", [b"", b"PK\x03\x04garbage", b"{}"], ids=["empty", "a broken zip", "JSON"])
def test_resume_from_a_corrupt_checkpoint_is_a_named_error(tmp_path, data):  # held
    from fedlab_nb.engine.checkpoint import CheckpointError
    (tmp_path / "c.pt").write_bytes(data)
    fed = fl.federate("digits", "iid", n_clients=3, seed=0)
    with pytest.raises(CheckpointError, match="c.pt"):
        fl.simulate("fedavg", fed, rounds=2, seed=0, checkpoint=tmp_path / "c.pt", resume=True, **RUN)


# ================================================================================ batch 2: (8) data fetch's archive
@pytest.mark.parametrize("case", ["not an archive", "a member outside the folder"])
def test_data_fetch_with_a_bad_archive_in_place_is_one_line(tmp_path, case):
    import io
    import tarfile
    folder = tmp_path / "d"
    folder.mkdir()
    archive = folder / "cifar-10-python.tar.gz"
    if case == "not an archive":
        archive.write_bytes(b"not a tar")
    else:
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo("../escape.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    rc, out, err = cli(["--root", root_copy(tmp_path), "data", "fetch", "cifar10", "--dir", folder])
    assert not (tmp_path / "escape.txt").exists()
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)


@pytest.mark.parametrize("case", ["the archive a folder", "--dir a file"])
def test_data_fetch_with_a_folder_or_file_in_the_way_is_one_line(tmp_path, case):  # held
    target = tmp_path / "d"
    if case == "the archive a folder":
        (target / "cifar-10-python.tar.gz").mkdir(parents=True)
        name = "cifar10"
    else:
        target.write_text("x")
        name = "mnist"
    rc, out, err = cli(["--root", root_copy(tmp_path), "data", "fetch", name, "--dir", target])
    one_line_error(rc, err)


# ================================================================================ (new code) the loss check's rows
def test_an_ignore_index_loss_is_judged_the_same_when_its_labels_shift_by_one_row():
    import torch.nn.functional as F

    from fedlab_nb.data.federated import FederatedDataset
    from fedlab_nb.engine.server import _spread

    def ignoring(outputs, y, reduction="mean"):
        return F.cross_entropy(outputs, y, ignore_index=0, reduction=reduction)
    rng = np.random.default_rng(0)
    n = 200
    x = rng.normal(size=(n, 5)).astype(np.float32)
    looked_at = set(_spread(n, 64).tolist())
    y = np.array([1 + i % 2 if i in looked_at else 0 for i in range(n)])  # class 0 (ignored) between the checked rows
    clients = [(rng.normal(size=(20, 5)).astype(np.float32), rng.integers(0, 3, 20)) for _ in range(3)]
    outcomes = []
    for labels in (y, np.roll(y, 1)):
        fed = FederatedDataset.from_clients(clients, test=(x, labels))
        try:
            fl.simulate("fedavg", fed, "logreg", loss=ignoring, rounds=1, batch_size=8, progress=False, seed=0)
            outcomes.append("ran")
        except ValueError:
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1], outcomes


# ================================================================================ (8) history's sidecar a folder
def test_history_with_the_sidecar_a_folder_names_the_sidecar(tmp_path):
    (tmp_path / "h.csv").write_text("round,test_acc\n1,0.5\n")
    (tmp_path / "h.json").mkdir()
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    one_line_error(rc, err)
    assert "h.json" in err, err


# ================================================================================ (7) results a FIFO or a device
@pytest.mark.parametrize("cmd", [["list"], ["report"], ["run", "tiny"], ["lab", "--dry-run"]])
@pytest.mark.parametrize("kind", ["FIFO", "/dev/null"])
def test_a_results_path_that_is_a_fifo_or_a_device_is_one_line(tmp_path, cmd, kind):  # held
    results = tmp_path / "fifo"
    if kind == "FIFO":
        os.mkfifo(results)
    else:
        results = "/dev/null"
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", results, *cmd])
    one_line_error(rc, err)


def test_the_results_flag_wins_over_the_environment(tmp_path, monkeypatch):  # held
    root = root_copy(tmp_path)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tiny-smoke.json").write_text(json.dumps(RESULT))
    monkeypatch.setenv("FEDLAB_NB_RESULTS", str(tmp_path / "a"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "b", "report"])
    assert rc == 0 and (tmp_path / "b" / "REPORT.md").is_file() and not list((tmp_path / "a").iterdir())


# ================================================================================ (8) claims files: encoding, size
@pytest.mark.parametrize("cmd", [["list"], ["params", "tiny"]])
def test_a_utf16_claims_file_is_one_line(tmp_path, cmd):  # held
    root = root_copy(tmp_path)
    path = root / "papers" / "tiny.yaml"
    path.write_bytes(path.read_text().encode("utf-16"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
    assert rc == 1 and "UTF-8" in out + err and "Traceback" not in err, (rc, err)


@pytest.mark.parametrize("digits", [5000, 400000])
@pytest.mark.parametrize("cmd", [["list"], ["params", "tiny"], ["run", "tiny"]])
def test_a_scale_parameter_of_thousands_of_digits_is_one_line(tmp_path, cmd, digits):  # held
    root = root_copy(tmp_path, lambda t: t.replace("{n_points: 4}", "{n_points: %s}" % ("9" * digits)))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
    assert rc == 1 and "digits" in out + err and "Traceback" not in err and len(out + err) < 2000, (rc, err[:300])


@pytest.mark.parametrize("cmd", [["params", "tiny"], ["run", "tiny"]])
def test_a_notebook_field_naming_a_folder_is_one_line(tmp_path, cmd):  # held
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb", "notebook: notebooks"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
    one_line_error(rc, err)


@pytest.mark.parametrize("value", [".NaN", "[1, .inf]", "{a: .nan}"])
def test_p_values_not_finite_in_other_yaml_forms_are_refused_before_a_kernel(tmp_path, value):  # held
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "run", "tiny", "-p", "value",
                        value])
    one_line_error(rc, err)
    assert not list(tmp_path.rglob("*.ipynb.*")) and not (tmp_path / "res" / "runs").exists()


# ================================================================================ (6) the survivors a server sends
@pytest.mark.parametrize("edit", ["this client left out", "one user repeated", "reversed", "another user left out"])
def test_secagg_a_survivor_list_edited_for_one_client_aborts_or_sums_exactly(edit):  # held
    from test_probe42k import _secagg_round

    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort

    def change(at, m):
        if at != "survivors":
            return m
        width = len(m) // 4
        recs = [m[i:i + width] for i in range(0, len(m), width)]
        recs = {"this client left out": recs[1:], "one user repeated": recs + [recs[1]], "reversed": recs[::-1],
                "another user left out": [recs[0], recs[1], recs[3]]}[edit]
        return b"".join(recs)
    try:
        x, total = _secagg_round(tamper_server=change)
    except SecAggAbort:
        return
    assert np.array_equal(total, x.sum(0).astype(np.uint64))


# ================================================================================ (new code) store: special files
@pytest.mark.parametrize("case", ["the figures folder a FIFO", "the JSON a FIFO", "the JSON a dangling link"])
def test_store_with_special_files_in_the_store_never_blocks_or_writes_through(tmp_path, case):  # held
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _to_store(tmp_path)
    store = root / "papers" / "paper_scale"
    store.mkdir()
    if case == "the figures folder a FIFO":
        os.mkfifo(store / "tiny")
    elif case == "the JSON a FIFO":
        os.mkfifo(store / "tiny.json")
    else:
        (store / "tiny.json").symlink_to(tmp_path / "victim.json")
    try:
        module.store("tiny", results, root)
    except SystemExit as e:
        assert isinstance(e.code, str)
        assert not (tmp_path / "victim.json").exists()
        return
    assert json.loads((store / "tiny.json").read_text())["scale"] == "paper"
    assert not (tmp_path / "victim.json").exists()


# ================================================================================ batch 3: (1) the accountant
@pytest.mark.parametrize("kw", [dict(accountant="rdp"), dict(accountant="pld"),
                                dict(sampling="fixed", sampling_rate=0.3), dict(adaptive=True, clip_count_stddev=1.0)],
                         ids=["rdp", "pld", "fixed", "adaptive"])
def test_dp_history_epsilon_equals_the_accountant_for_every_round(fed10, kw):  # held
    from fedlab_nb.methods.privacy.dp import central_epsilon
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    settings = {**dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.2), **kw}
    method, sampler = dp_fedavg_with_sampler(fed10, **settings)
    h, _ = trace(method, fed10, sampler, 5)
    want = [central_epsilon(settings["sampling_rate"], 1.0, t, 1e-5, accountant=settings.get("accountant", "rdp"),
                            sampling=settings.get("sampling", "poisson")) for t in range(1, 6)]
    assert np.allclose(h["epsilon"], want, rtol=1e-9), (list(h["epsilon"]), want)


def test_local_dp_epsilon_follows_the_most_sampled_client(fed10):  # held
    from fedlab_nb.engine.sampling import UniformSampler
    from fedlab_nb.methods.privacy.dp import local_epsilon
    from fedlab_nb.methods.privacy.dp_fedavg import local_dp_fedavg
    seen, inner = [], UniformSampler(3)

    def sampler(r, k, g):
        ids = inner(r, k, g)
        seen.append(np.asarray(ids).copy())
        return ids
    h, _ = trace(local_dp_fedavg(noise_multiplier=1.0, clip_norm=0.5), fed10, sampler, 6)
    counts, want = np.zeros(10, int), []
    for ids in seen:
        counts[ids] += 1
        want.append(local_epsilon(1.0, int(counts.max()), 1e-5))
    assert np.allclose(h["epsilon"], want), (list(h["epsilon"]), want)


# ================================================================================ (4) parameter names as code
def test_a_scale_parameter_name_holding_code_is_refused_before_a_kernel(tmp_path):  # held
    root = root_copy(tmp_path, lambda t: t.replace("{n_points: 4}",
                                                   '{n_points: 4, "value = 1\\nprint(\'PWNED\')\\nx": 1}'))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny"])
    one_line_error(rc, err)
    assert "PWNED" not in out and not (tmp_path / "res" / "runs").exists()


@pytest.mark.parametrize("name", ["value\nimport os", "__builtins__", "value=1;x"])
def test_p_names_that_are_not_notebook_parameters_are_refused(tmp_path, name):  # held
    rc, out, err = cli(["--root", root_copy(tmp_path), "--results", tmp_path / "res", "run", "tiny", "-p", name, "1"])
    one_line_error(rc, err)
    assert not (tmp_path / "res" / "runs").exists()


# ================================================================================ (3) the run folder taken
@pytest.mark.parametrize("case", ["a file", "a link", "a FIFO"])
def test_run_with_its_folder_taken_is_refused_before_a_kernel(tmp_path, case):  # held
    from fedlab_nb.repro import runner
    from fedlab_nb.repro.claims import load_paper
    root, results = root_copy(tmp_path), tmp_path / "res"
    params, _ = runner.build_parameters(load_paper("tiny", root), "smoke", {}, None)
    folder = runner.run_folder("tiny", "smoke", params, results)
    folder.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    {"a file": lambda: folder.write_text("x"), "a link": lambda: folder.symlink_to(victim),
     "a FIFO": lambda: os.mkfifo(folder)}[case]()
    rc, out, err = cli(["--root", root, "--results", results, "run", "tiny"])
    one_line_error(rc, err)
    assert sorted(p.name for p in victim.iterdir()) == ["keep"] and "running" not in err


# ================================================================================ (8) a corrupt stored result
@pytest.mark.parametrize("data", [b"[" * 100000 + b"]" * 100000, b"\xff\xfe\x00{",
                                  b'{"paper": "tiny", "scale": 1e999}',
                                  b'{"paper": "tiny", "scale": "paper", "claims": "x", "metrics": [1]}'],
                         ids=["deep", "non-UTF-8", "a scale beyond double", "claims a string"])
@pytest.mark.parametrize("cmd", [["list"], ["report"]])
def test_a_corrupt_stored_paper_scale_result_breaks_nothing(tmp_path, data, cmd):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    (root / "papers" / "paper_scale").mkdir()
    (root / "papers" / "paper_scale" / "tiny.json").write_bytes(data)
    rc, out, err = cli(["--root", root, "--results", results, *cmd])
    _no_traceback(rc, err)
    assert "tiny" in (out if cmd == ["list"] else (results / "REPORT.md").read_text())


# ================================================================================ batch 4: (7) publish part-way
def _published(tmp_path):
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    for folder, text in ((tmp, "new"), (out, "old")):
        (folder / "tiny-smoke").mkdir(parents=True)
        (folder / "tiny-smoke" / f"{text}.png").write_text(text)
        (folder / "tiny-smoke.json").write_text(text)
    (tmp / "tiny-smoke.ipynb").write_text("new")
    return tmp, out


@pytest.mark.parametrize("case", ["a folder where the notebook goes", "interrupted before the notebook"])
def test_publish_stopped_part_way_keeps_the_old_result_with_its_figures(tmp_path, monkeypatch, case):
    from fedlab_nb.repro.files import UnsafePathError, publish
    tmp, out = _published(tmp_path)
    if case == "a folder where the notebook goes":
        (out / "tiny-smoke.ipynb").mkdir()
        stop = UnsafePathError
    else:
        (out / "tiny-smoke.ipynb").write_text("old")
        real, calls = os.replace, []

        def replace(a, b):
            calls.append(b)
            if len(calls) == 2:  # the notebook's move, after the figures folder's
                raise KeyboardInterrupt
            return real(a, b)
        monkeypatch.setattr(os, "replace", replace)
        stop = KeyboardInterrupt
    with pytest.raises(stop):
        publish(tmp, out, ["tiny-smoke", "tiny-smoke.ipynb", "tiny-smoke.json"])
    monkeypatch.undo()
    json_text = (out / "tiny-smoke.json").read_text()
    figures = sorted(p.name for p in (out / "tiny-smoke").iterdir())
    assert (json_text, figures) in (("old", ["old.png"]), ("new", ["new.png"])), (json_text, figures)


# ================================================================================ (5) HTML from result fields
def test_the_board_escapes_html_in_every_result_field(tmp_path):  # held
    evil = "x' onmouseover='alert(1)\" onclick=\"alert(2)<script>alert(3)<\\script>`${alert(4)}"
    claim = {"id": evil, "verdict": evil, "expect": evil, "role": "headline", "text": evil, "metric": evil,
             "reason": evil, "note": evil, "paper_value": evil, "ours": evil, "setting": {"paper": evil, "ours": evil}}
    result = {**RESULT, "verdict": evil, "metrics": {"value": evil, evil: 1}, "claims": [claim],
              "citation": {"title": evil, "url": "javascript:alert(5)", "authors": evil},
              "figures": [f"tiny-smoke/{evil}.png"], "notebook": evil, "error": {"ename": evil, "evalue": evil}}
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(result)})
    (results / "tiny-smoke").mkdir()
    (results / "tiny-smoke" / f"{evil}.png").write_bytes(PNG)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    html = (results / "index.html").read_text()
    assert rc == 0 and "onmouseover='" not in html and '"alert' not in html and "<script>alert" not in html
    assert "javascript:" not in html


@pytest.mark.parametrize("url", ["javascript:alert(1)", "https://x/' onmouseover='alert(1)",
                                 'http://x/"><script>alert(1)</script>'])
def test_a_claims_file_url_never_becomes_script(tmp_path, url):  # held
    root = root_copy(tmp_path, lambda t: t.replace("url: null", "url: %s" % json.dumps(url)))
    results = tmp_path / "results"
    results.mkdir()
    (results / "tiny-smoke.json").write_text(json.dumps(RESULT))
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    html = (results / "index.html").read_text()
    assert rc == 0 and "javascript:" not in html and "onmouseover='" not in html and "<script>alert" not in html


# ================================================================================ (2) figures update from a sub-folder
def test_figures_update_with_a_relative_root_writes_into_the_root(tmp_path, monkeypatch):  # held
    root = root_copy(tmp_path)
    good = tmp_path / "good"
    good.mkdir()
    (good / "main.data.json").write_text(json.dumps({"figure": "main", "series": [{"key": "a", "kind": "line",
                                                                                   "values": [1.0, 2.0]}]}))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    rc, out, err = cli(["--root", "../root", "figures", "update", "tiny", "--from", "../good"])
    assert rc == 0 and (root / "papers" / "figures" / "tiny.json").is_file(), (rc, err)
    assert not (tmp_path / "sub" / "papers").exists()


# ================================================================================ batch 5: (6) Flower reply identity
@pytest.mark.parametrize("cid", [0.0, "0", True, -0.0, 2 ** 70, float("nan"), 0.5, None, [0]])
def test_flower_client_id_variants_are_refused_naming_the_node(fed10, cid):  # held
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    before = s.theta.clone()
    reply = flower_reply(s, 0)
    reply.content["metrics"]["client-id"] = cid
    with pytest.raises(ValueError, match="client 0"):
        s.aggregate_train(1, [reply, flower_reply(s, 1)])
    assert torch.equal(s.theta, before)


@pytest.mark.parametrize("key", ["num-examples", "client-id", "steps", "train-loss", "bytes-up"])
def test_flower_reply_missing_a_metric_is_refused_naming_the_client(fed10, key):  # held
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    reply = flower_reply(s, 0)
    del reply.content["metrics"][key]
    with pytest.raises(ValueError, match="client 0"):
        s.aggregate_train(1, [reply, flower_reply(s, 1)])


# ================================================================================ (5)/(8) a name not UTF-8
def test_a_stale_result_whose_name_is_not_utf8_is_named_unambiguously(tmp_path):
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    with open(os.path.join(os.fsencode(results), b"tiny-sm\xffoke.json"), "w") as f:
        f.write("{}")
    rc, out, err = cli(["--root", root, "--results", results, "list"])
    assert rc == 0 and "Traceback" not in err
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warned and all(f"{results / 'tiny-smoke.json'} " not in line for line in warned), warned


# ================================================================================ batch 6: (1) the other DP mechanisms
def test_randomized_response_at_a_huge_epsilon_is_refused_or_keeps_values():
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    x = np.array([0, 1] * 50)
    try:
        out = L.randomized_response(x, 2, 800.0, rng)
    except ValueError:
        return
    assert np.isfinite(L.grr_probabilities(800.0, 2)).all() and (out == x).mean() > 0.99


@pytest.mark.parametrize("kw", [dict(bound=float("inf")), dict(sigma=float("nan")), dict(sigma=0.0),
                                dict(bound=-1.0)], ids=["bound inf", "sigma NaN", "sigma 0", "bound negative"])
def test_private_region_means_refuses_settings_that_void_the_guarantee(kw):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    args = {"bound": 1.0, "sigma": 0.1, **kw}
    with pytest.raises(ValueError, match="bound|sigma"):
        L.private_region_means(np.array([0, 0, 1, 1]), np.array([0.2, 0.9, 5000.0, 0.4]), 2, rng=rng, **args)


@pytest.mark.parametrize("call", ["classic radius -1", "classic delta 2", "classic m 0", "locational sensitivity inf",
                                  "locational delta text"])
def test_gaussian_calibrations_refuse_bad_arguments_naming_them(call):
    from fedlab_nb.methods.beyond import locational_dp as L
    from fedlab_nb.methods.more import dp_robust as R
    run = {"classic radius -1": lambda: R.classic_sigma(-1.0, 5, 0.5, 1e-5),
           "classic delta 2": lambda: R.classic_sigma(1.0, 5, 0.5, 2.0),
           "classic m 0": lambda: R.classic_sigma(1.0, 0, 0.5, 1e-5),
           "locational sensitivity inf": lambda: L.gaussian_sigma(1.0, 1e-5, float("inf")),
           "locational delta text": lambda: L.gaussian_sigma(1.0, "1e-5", 1.0)}[call]
    with pytest.raises(ValueError, match="radius|delta|m |m=|sensitivity"):
        run()


@pytest.mark.parametrize("call", ["noisy_argmax of -1", "region shares of 0.7 and 1.2"])
def test_locational_dp_mechanisms_refuse_out_of_range_inputs(call):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        if call == "noisy_argmax of -1":
            L.noisy_argmax(np.array([-1, 0]), 3, 1.0, rng)
        else:
            L.private_region_shares(np.array([0, 0, 1, 1]), np.array([0.7, 1.2, 0.2, 0.9]), 2, 1.0, rng)


@pytest.mark.parametrize("kw", [dict(radius=float("inf")), dict(epsilon=float("inf")), dict(delta=0.0)],
                         ids=["radius inf", "epsilon inf", "delta 0"])
def test_private_robust_mean_refuses_settings_that_void_the_guarantee(kw):  # held
    from fedlab_nb.methods.more import dp_robust as R
    points = torch.randn(7, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError):
        R.private_robust_mean(points, 1, **{**dict(epsilon=1.0, delta=1e-5, radius=1.0), **kw})


# ================================================================================ batch 7: (5) the parameters cell
@pytest.mark.parametrize("line", ['value: "a\x1b[2J\u202eb" = 0.5', "value = 0.5  # c\x1b]0;x\x07", 'value = "\x1b[2J"',
                                  'value: list["\u2066x"] = [1]'],
                         ids=["annotation", "comment", "default", "nested annotation"])
@pytest.mark.parametrize("cmd", [["params", "tiny"], ["lab", "--dry-run"]])
def test_escapes_in_the_parameters_cell_are_never_printed(tmp_path, line, cmd):  # held
    root = root_copy(tmp_path)
    path = root / "notebooks" / "tiny.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"][1]["source"] = f'scale = "smoke"\nseed = 0\ndevice = "cpu"\n{line}\nn_points = 3\nfail = False'
    path.write_text(json.dumps(nb))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", *cmd])
    assert rc == 0 and _clean(out + err), repr(out + err)


# ================================================================================ (2) the options given twice
@pytest.mark.parametrize("where", ["--results", "--root"])
def test_an_option_given_before_and_after_the_command_takes_the_later(tmp_path, where):  # held
    roots = [root_copy(tmp_path / name) for name in ("a", "b")]
    (roots[1] / "papers" / "tiny.yaml").write_text((roots[1] / "papers" / "tiny.yaml").read_text().replace(
        'method: "Tiny — harness fixture"', 'method: "the second root"'))
    if where == "--root":
        rc, out, err = cli(["--root", roots[0], "list", "--root", roots[1]])
        assert rc == 0 and "the second root" in out, (rc, out, err)
    else:
        rc, out, err = cli(["--root", roots[0], "--results", tmp_path / "r1", "report", "--results", tmp_path / "r2"])
        assert rc == 0 and (tmp_path / "r2" / "REPORT.md").is_file() and not (tmp_path / "r1").exists()


# ================================================================================ batch 8: (1) DP-SGD's clip settings
@pytest.mark.parametrize("clip", [float("inf"), "2"], ids=["inf", "text"])
def test_lora_dp_method_refuses_a_clip_that_is_not_a_finite_number(clip):
    import torch.nn as nn

    from fedlab_nb.lora import add_lora
    from fedlab_nb.methods.privacy.fedsvd import lora_dp_method
    model = add_lora(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), 2, None, None, seed=0)
    with pytest.raises(ValueError, match="clip_norm"):
        lora_dp_method(model, "fedsvd", clip_norm=clip, noise_multiplier=1.0)


@pytest.mark.parametrize("kw", [dict(clip=float("inf")), dict(noise_multiplier=float("inf")), dict(clip=-1.0),
                                dict(noise_multiplier=float("nan"))], ids=["clip inf", "noise inf", "clip -1",
                                                                            "noise NaN"])
def test_cpa_dp_fc_gradient_refuses_settings_that_void_the_guarantee(kw):  # held
    import torch.nn as nn

    from fedlab_nb.methods.privacy.cpa import dp_fc_gradient
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with pytest.raises(ValueError):
        dp_fc_gradient(model, x, y, **{**dict(clip=1.0, noise_multiplier=1.0), **kw})


# ================================================================================ batch 9: (4) size
def test_a_claims_file_at_the_size_limit_loads_quickly_or_is_refused(tmp_path):
    import signal

    from fedlab_nb.repro.claims import ReproError, load_claims
    big = ",".join(["1"] * 480000)
    root = root_copy(tmp_path, lambda t: t.replace("{n_points: 4}", "{n_points: 4, big: [%s]}" % big))
    path = root / "papers" / "tiny.yaml"
    assert path.stat().st_size < 1_000_000

    class TooSlow(BaseException):  # not an OSError (TimeoutError is one): nothing in the loader may catch it
        pass

    def too_slow(*_):
        raise TooSlow
    old = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        load_claims(path)
    except ReproError:
        pass  # refused as too large or too long a list: fine
    except TooSlow:
        pytest.fail("still loading after 3 s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ================================================================================ batch 10: (3) special files
@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_report_replaces_a_fifo_at_the_board_and_never_blocks(tmp_path, name):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    os.mkfifo(results / name)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert rc == 0 and (results / name).is_file() and not (results / name).is_fifo(), (rc, err)


@pytest.mark.parametrize("name", ["h.csv", "h.json"])
def test_history_save_replaces_a_fifo_and_never_blocks(tmp_path, name):  # held
    h = fl.simulate("fedavg", fl.federate("digits", "iid", n_clients=3, seed=0), "logreg", rounds=1, progress=False)
    os.mkfifo(tmp_path / name)
    try:
        h.save(tmp_path / "h.csv")
    except ValueError:
        return  # refused, naming the special file: fine
    assert fl.History.load(tmp_path / "h.csv").meta.get("method") == h.meta.get("method")
