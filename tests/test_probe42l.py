"""Probe 42l: a twelfth, independent re-run of issue 42's failure classes, aimed first at what is new since the
eleventh (label-DP bag responses' checks, History.save's .json refusal, paper_scale.py store's temporary JSON and
roll-back, secure aggregation with every update dropped, share ciphertexts bound to the roster, write_course's
folders, from_clients' label messages), with variants test_probe42*.py do not try. Each test asserts the correct
behaviour; a test marked xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays
green until it is fixed."""
import json
import os

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.data.federated import FederatedDataset
from probes import KW as RUN  # noqa: F401
from probes import REPO, cli, fed10, one_line_error, root_copy, script, trace  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_  # noqa: F401 (a new finding is marked with it)
from probes import (  # noqa: F401 (shared by the probe files)
    CONTROL, PNG, RESULT, clean as _clean, no_traceback as _no_traceback, interrupted_dp_run)

def pairs(seed=0, n=3, rows=20):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 5)).astype(np.float32), rng.integers(0, 3, rows)) for _ in range(n)]


def _results(tmp_path, **files):
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    for name, text in files.items():
        (results / name).write_text(text, encoding="utf-8")
    return root, results


# ================================================================================ (1) DP and label DP
def test_label_dp_bag_responses_refuse_an_infinite_epsilon():
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="epsilon"):  # ε = inf: a Laplace scale of 0, the bag means released bare
        A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng), float("inf"), 1.0, rng)


def test_label_dp_bag_responses_with_missing_values_as_none_is_a_named_error():
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    y = np.array([1.0, None] * 10, dtype=object)
    with pytest.raises(ValueError, match="y"):
        A.dp_bag_responses(y, A.random_bags(20, 4, rng), 1.0, 1.0, rng)


def test_label_dp_bag_responses_with_integer_responses_are_released(tmp_path):  # held
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    out = A.dp_bag_responses(np.arange(20), A.random_bags(20, 4, rng), 1.0, 3.0, rng)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("kw", [dict(noise_multiplier=1e300, clip_norm=1.0),
                                dict(noise_multiplier=1.0, clip_norm=1e-320)], ids=["huge noise", "subnormal clip"])
def test_dp_extreme_but_finite_settings_are_refused_or_keep_theta_finite(fed10, kw):
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    try:
        method, sampler = dp_fedavg_with_sampler(fed10, sampling_rate=0.3, **kw)
        h, seen = trace(method, fed10, sampler, 2)
    except ValueError:
        return  # refused with a named error: fine
    assert all(torch.isfinite(t).all() for t in seen) and np.isfinite(h["epsilon"]).all()


# ================================================================================ (2) relative paths
def test_report_with_a_relative_results_env_with_dot_dot_from_a_sub_folder(tmp_path, monkeypatch):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    monkeypatch.setenv("FEDLAB_NB_RESULTS", "../sub/../results")
    rc, out, err = cli(["--root", "../root", "report"])
    assert rc == 0 and (results / "REPORT.md").is_file(), (rc, err)


def test_an_empty_results_env_means_the_default(tmp_path, monkeypatch):  # held
    root = root_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDLAB_NB_RESULTS", "")
    rc, out, err = cli(["--root", "root", "report"])
    assert rc == 0 and (root / "results" / "REPORT.md").is_file() and not (tmp_path / "REPORT.md").exists()


# ================================================================================ (3) links
def test_staging_does_not_delete_through_a_leftover_running_link(tmp_path):  # held
    from fedlab_nb.repro.files import staging
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    results = tmp_path / "results"
    results.mkdir()
    (results / ".tiny-smoke.abc.running").symlink_to(victim)
    with staging(results, "tiny-smoke"):
        pass
    assert (victim / "keep.txt").read_text() == "x"


def test_publish_refuses_a_notebook_link_before_moving_anything(tmp_path):  # held
    from fedlab_nb.repro.files import UnsafePathError, publish
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir(), out.mkdir()
    (tmp / "tiny-smoke").mkdir()
    (tmp / "tiny-smoke.ipynb").write_text("new")
    (tmp / "tiny-smoke.json").write_text("new")
    (tmp_path / "victim.ipynb").write_text("old")
    (out / "tiny-smoke.ipynb").symlink_to(tmp_path / "victim.ipynb")
    with pytest.raises(UnsafePathError):
        publish(tmp, out, ["tiny-smoke", "tiny-smoke.ipynb", "tiny-smoke.json"])
    assert (tmp_path / "victim.ipynb").read_text() == "old" and not (out / "tiny-smoke").exists()


def test_a_notebook_link_inside_notebooks_pointing_outside_the_root_is_not_used(tmp_path):
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb", "notebook: notebooks/evil.ipynb"))
    outside = tmp_path / "outside.ipynb"
    outside.write_bytes((root / "notebooks" / "tiny.ipynb").read_bytes())
    (root / "notebooks" / "evil.ipynb").symlink_to(outside)
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "params", "tiny"])
    assert rc in (1, 2) and "Traceback" not in err, (rc, out[-300:], err[-300:])


# ================================================================================ (4) paths confined
def test_report_does_not_link_a_figure_whose_name_url_decodes_outside(tmp_path):
    result = {**RESULT, "figures": ["tiny-smoke/%2e%2e/%2e%2e/secret.png", "tiny-smoke/..%2f..%2fsecret.png"]}
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(result)})
    (results / "tiny-smoke").mkdir()
    cli(["--root", root, "--results", results, "report"])
    for name in ("REPORT.md", "index.html"):
        assert "secret.png" not in (results / name).read_text(), name


# ================================================================================ (5) control characters
def test_list_strips_control_characters_from_a_result_file_name(tmp_path):
    root, results = _results(tmp_path, **{"tiny-sm\x1b]0;pwned\x07oke.json": "{}"})
    rc, out, err = cli(["--root", root, "--results", results, "list"])
    assert "Traceback" not in err and _clean(out + err), repr(out + err)[-400:]


def test_report_board_strips_control_characters_from_a_result_file_name(tmp_path):
    root, results = _results(tmp_path, **{"tiny-sm\x1b]0;pwned\x07oke.json": json.dumps(RESULT)})
    cli(["--root", root, "--results", results, "report"])
    for name in ("REPORT.md", "index.html"):
        assert _clean((results / name).read_text()), name


def test_history_strips_control_characters_from_csv_column_names(tmp_path):
    (tmp_path / "h.csv").write_text("round,acc\x1b[2J\u202e,bytes_up\n0,0.5,10\n1,0.6,20\n")
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert "Traceback" not in err and _clean(out + err), repr(out + err)[-400:]


# ================================================================================ (new code) History.save
def test_history_saves_to_dotted_names_without_a_suffix_keep_their_own_metadata(tmp_path):
    fed = fl.federate("digits", "iid", n_clients=3, seed=0)
    a = fl.simulate("fedavg", fed, "logreg", rounds=1, lr=0.1, progress=False)
    b = fl.simulate("fedprox", fed, "logreg", rounds=1, lr=0.05, progress=False)
    a.save(tmp_path / "run_lr0.1")  # both sidecars are run_lr0.json: the second save replaces the first's metadata
    try:
        b.save(tmp_path / "run_lr0.05")
    except ValueError:
        return  # refused, naming the clash: fine
    assert fl.History.load(tmp_path / "run_lr0.1").meta.get("method") == a.meta.get("method")


@pytest.mark.parametrize("name", ["b.JSON", "c.jSoN", "d.csv.json"])
def test_history_save_refuses_json_names_of_any_case(tmp_path, name):  # held
    h = fl.simulate("fedavg", fl.federate("digits", "iid", n_clients=3, seed=0), "logreg", rounds=1, progress=False)
    with pytest.raises(ValueError, match="csv"):
        h.save(tmp_path / name)
    assert not list(tmp_path.iterdir())


# ================================================================================ (6) Flower and from_clients
@pytest.mark.parametrize("value", [True, 1.0, "0b1", "-0", "+1", "1_0", "\u0661", 2 ** 70, np.bool_(True)])
def test_flower_partition_id_variants_are_refused(value):  # held
    from types import SimpleNamespace

    from fedlab_nb.flower import _client_id
    with pytest.raises(ValueError, match="partition-id"):
        _client_id(SimpleNamespace(node_config={"partition-id": value}), 3)


@pytest.mark.parametrize("labels", ["strings", "object ints", "object strings"])
def test_from_clients_non_numeric_labels_are_a_named_error(labels):  # held
    y = {"strings": np.array(["a", "b"] * 10), "object ints": np.array([0, 1] * 10, dtype=object),
         "object strings": np.array(["0", "1"] * 10, dtype=object)}[labels]
    x = np.zeros((20, 5), np.float32)
    with pytest.raises(ValueError, match="y"):
        FederatedDataset.from_clients([(x, y), (x, y)])


# ================================================================================ (6) secure aggregation
@pytest.mark.parametrize("on_abort", ["raise", "skip"])
def test_secagg_drop_leaving_one_finite_client_is_an_abort_or_a_kept_theta(on_abort):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import SecAggAbort, with_secure_aggregation
    clients = pairs(0, 4)
    for k in (0, 1, 2):
        clients[k] = (clients[k][0] * np.float32(1e30), clients[k][1])
    fed = FederatedDataset.from_clients(clients)
    method = with_secure_aggregation(fl.get_method("fedavg"), client_sizes=fed.sizes, on_abort=on_abort)
    run = dict(rounds=2, local_epochs=1, batch_size=8, lr=0.1, progress=False, seed=0, on_nonfinite="drop")
    if on_abort == "skip":
        assert torch.isfinite(fl.simulate(method, fed, "logreg", **run).theta).all()
    else:
        with pytest.raises(SecAggAbort, match="threshold"):
            fl.simulate(method, fed, "logreg", **run)


@pytest.mark.parametrize("sizes", [(float("nan"), 20, 20, 20), (True, 20, 20, 20), (-1, 20, 20, 20), (20, 20, 20)],
                         ids=["nan", "bool", "negative", "one short"])
def test_secagg_client_sizes_variants_are_named_errors(sizes):  # held
    from fedlab_nb.methods.privacy.secure_aggregation import with_secure_aggregation
    fed = FederatedDataset.from_clients(pairs(0, 4))
    with pytest.raises(ValueError, match="client_sizes"):
        method = with_secure_aggregation(fl.get_method("fedavg"), client_sizes=sizes)
        fl.simulate(method, fed, "logreg", rounds=1, progress=False, seed=0)


# ================================================================================ (8) corrupt result files
ODD = {"nan and inf metrics": {**RESULT, "metrics": {"value": float("nan"), "double": float("inf")}},
       "a million-character verdict": {**RESULT, "verdict": "x" * 10 ** 6},
       "a claim id that is a mapping": {**RESULT, "claims": [{**RESULT["claims"][0], "id": {"a": 1}}]},
       "a claim verdict that is a list": {**RESULT, "claims": [{**RESULT["claims"][0], "verdict": ["a"]}]},
       "figures a mapping": {**RESULT, "figures": {"a": 1}},
       "figures of odd types": {**RESULT, "figures": [1, None, ["x"]]},
       "another scale inside": {**RESULT, "scale": "paper"},
       "control characters in unused fields": {**RESULT, "started": "\x1b[2J", "wall_seconds": -1e308}}


@pytest.mark.parametrize("case", list(ODD))
def test_list_and_report_survive_more_odd_result_fields(tmp_path, case):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(ODD[case])})
    for cmd in (["list"], ["report"]):
        rc, out, err = cli(["--root", root, "--results", results, *cmd])
        _no_traceback(rc, err)
        assert _clean(out + err), (cmd, repr(out + err)[-300:])


@pytest.mark.parametrize("text", ['{"paper":"tiny","paper":"x","scale":"smoke","verdict":"reproduced","claims":[]}',
                                  '{"paper":"tiny","scale":"smoke","verdict":"reproduced","metrics":{"value":1e400},'
                                  '"claims":[]}'], ids=["duplicate keys", "a float beyond double"])
def test_list_and_report_survive_json_edge_cases(tmp_path, text):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": text})
    for cmd in (["list"], ["report"]):
        rc, out, err = cli(["--root", root, "--results", results, *cmd])
        _no_traceback(rc, err)


# ================================================================================ (new code) paper_scale.py store
def _to_store(tmp_path, **over):
    root, results = root_copy(tmp_path), tmp_path / "results"
    (results / "tiny-paper").mkdir(parents=True)
    (results / "tiny-paper" / "main.png").write_bytes(PNG + b"old")
    result = {**RESULT, "scale": "paper", "error": None, "figures": ["tiny-paper/main.png"], "figure_data": [], **over}
    (results / "tiny-paper.json").write_text(json.dumps(result))
    return root, results


def test_store_with_the_stored_json_a_folder_is_one_line(tmp_path):
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _to_store(tmp_path)
    (root / "papers" / "paper_scale" / "tiny.json").mkdir(parents=True)
    (root / "papers" / "paper_scale" / "tiny.json" / "keep").write_text("x")
    with pytest.raises(SystemExit):
        module.store("tiny", results, root)
    assert sorted(p.name for p in (root / "papers" / "paper_scale").iterdir()) == ["tiny.json"]


def test_store_with_the_store_folder_a_file_names_the_right_fix(tmp_path):
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _to_store(tmp_path)
    (root / "papers" / "paper_scale").write_text("x")
    with pytest.raises(SystemExit) as e:
        module.store("tiny", results, root)
    assert "--results" not in str(e.value.code), e.value.code


@pytest.mark.parametrize("over", [dict(error="boom"), dict(error=["x"]), dict(error={"ename": "\x1b[2Jx"}),
                                  dict(figures=[1]), dict(figures=[None]), dict(figures=["."]), dict(figures=[""]),
                                  dict(figure_data=["tiny-paper/main.png"]), dict(paper="ti\x1bny"), dict(scale=3)],
                         ids=["error a string", "error a list", "error with escapes", "figure an int", "figure null",
                              "figure '.'", "figure ''", "figure twice", "paper with escapes", "scale an int"])
def test_store_refuses_odd_result_fields_in_one_clean_line(tmp_path, over):  # held
    module = script(REPO / "scripts" / "paper_scale.py")
    root, results = _to_store(tmp_path, **over)
    with pytest.raises(SystemExit) as e:
        module.store("tiny", results, root)
    assert isinstance(e.value.code, str) and _clean(e.value.code) and "\n" not in e.value.code
    assert not (root / "papers" / "paper_scale" / "tiny.json").exists()


# ================================================================================ (new code) the loss check's reach
def test_an_ignore_index_loss_is_judged_the_same_whatever_order_the_test_set_has():
    import torch.nn.functional as F

    def ignoring(outputs, y, reduction="mean"):
        return F.cross_entropy(outputs, y, ignore_index=0, reduction=reduction)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 5)).astype(np.float32), np.sort(rng.integers(0, 3, 200))
    outcomes = []
    for labels in (y, y[::-1].copy()):
        fed = FederatedDataset.from_clients(pairs(0), test=(x, labels))
        try:
            fl.simulate("fedavg", fed, "logreg", loss=ignoring, rounds=1, batch_size=8, progress=False, seed=0)
            outcomes.append("ran")
        except ValueError:
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1], outcomes


# ================================================================================ (4) bombs in a claims file
def test_an_expectation_cannot_repeat_a_string_by_a_metric():
    from fedlab_nb.repro.expect import ExpectationError, MetricError, parse_expectation
    try:
        expect = parse_expectation('== "abcdefgh" * n')
    except ExpectationError:
        return  # strings in arithmetic refused when the claims file is read: fine
    with pytest.raises(MetricError):
        expect.holds(1.0, {"n": 10 ** 13})


# ================================================================================ (1) label DP: shapes and types
def test_label_dp_bag_responses_refuse_multi_column_responses():
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="y"):
        A.dp_bag_responses(rng.normal(size=(20, 3)), A.random_bags(20, 4, rng), 1.0, 1.0, rng)


@pytest.mark.parametrize("case", ["float bags", "negative draws"])
def test_label_dp_bag_responses_odd_bags_and_draws_are_named_errors(case):
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    bags = A.random_bags(20, 4, rng)
    kw = dict(bags=bags.astype(float)) if case == "float bags" else dict(bags=bags, draws=-1)
    with pytest.raises(ValueError, match="bags|draws"):
        A.dp_bag_responses(rng.normal(size=20), epsilon=1.0, clip=1.0, rng=rng, **kw)


@pytest.mark.parametrize("epsilon", [float("nan"), -1.0, 0.0])
def test_label_dp_bag_responses_refuse_bad_epsilons(epsilon):  # held
    from fedlab_nb.methods.privacy import aggregate_responses as A
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="epsilon"):
        A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng), epsilon, 1.0, rng)


# ================================================================================ (7) the lock
def _hold_lock(lock, text):
    import subprocess
    import sys
    lock.write_text(text)
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdout=subprocess.PIPE)
    holder.stdout.readline()
    return holder


def test_a_locked_paper_with_escapes_in_the_lock_file_is_one_clean_line(tmp_path):  # held
    root, results = _results(tmp_path)
    holder = _hold_lock(results / "tiny.lock", json.dumps({"pid": 1, "host": "h\x1b]0;pwned\x07\u202e",
                                                           "scale": "s\x1b[2J", "started": "\x9b31m"}))
    try:
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny", "-j", "1"])
    finally:
        holder.kill()
        holder.wait()
    assert rc == 1 and "another run" in out + err and _clean(out + err), (rc, repr(out + err))


def test_run_refused_by_the_lock_does_not_announce_a_folder_it_never_makes(tmp_path):
    root, results = _results(tmp_path)
    holder = _hold_lock(results / "tiny.lock", "{}")
    try:
        rc, out, err = cli(["--root", root, "--results", results, "run", "tiny"])
    finally:
        holder.kill()
        holder.wait()
    assert rc == 1 and "another run" in err, (rc, out, err)
    named = [w for w in (out + err).split() if "/runs/" in w]
    assert all(os.path.exists(w) for w in named), named


# ================================================================================ (1) DP with stragglers and backends
@pytest.mark.parametrize("kw", [dict(stragglers=0.9, drop_stragglers=True), dict(stragglers=0.9), dict(eval_every=3)],
                         ids=["stragglers dropped", "stragglers kept", "eval every 3"])
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_dp_rounds_stay_noised_with_stragglers_and_sparse_evaluation(fed10, kw, sampling):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.2,
                                             sampling=sampling)
    h, seen = trace(method, fed10, sampler, 6, **kw)
    assert all(not torch.equal(a, b) for a, b in zip(seen[1:], seen[:-1])) and np.isfinite(h["epsilon"]).all()


@pytest.mark.parametrize("change", [dict(sampling_rate=0.5), dict(clip_norm=5.0), dict(sampling="fixed"),
                                    dict(delta=1e-3), dict(accountant="pld")])
def test_dp_resume_with_other_privacy_settings_is_refused(fed10, tmp_path, change):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    base = dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.3)
    interrupted_dp_run(fed10, tmp_path / "c.pt", **base)
    m2, s2 = dp_fedavg_with_sampler(fed10, **{**base, **change})
    with pytest.raises(ValueError, match="checkpoint"):
        fl.simulate(m2, fed10, rounds=4, clients_per_round=s2, seed=0, checkpoint=tmp_path / "c.pt", resume=True,
                    **RUN)


# ================================================================================ (4) claims-file tags
@pytest.mark.parametrize("value", ["!!set {a, b}", "!!binary aGVsbG8=", "2001-12-14t21:59:43.10-05:00",
                                   "!!python/object/apply:os.system ['echo PWNED']"],
                         ids=["set", "binary", "timestamp", "python object"])
def test_scale_parameters_of_odd_yaml_types_are_refused_before_a_kernel(tmp_path, value):  # held
    root = root_copy(tmp_path, lambda t: t.replace("{n_points: 4}", "{n_points: %s}" % value))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny"])
    assert rc in (1, 2) and "Traceback" not in err and "PWNED" not in out + err, (rc, out, err)
    assert not (tmp_path / "res" / "tiny-smoke.ipynb").exists()


# ================================================================================ (3)/(8) lab's notebooks
@pytest.mark.parametrize("case", ["corrupt", "link outside", "non-UTF-8", "FIFO"])
@pytest.mark.parametrize("student", [False, True], ids=["instructor", "student"])
def test_lab_with_an_odd_notebook_is_one_line_and_copies_nothing_outside(tmp_path, case, student):  # held
    root = root_copy(tmp_path)
    nbs = root / "notebooks"
    if case == "corrupt":
        (nbs / "bad.ipynb").write_text('{"cells": [')
    elif case == "link outside":
        (tmp_path / "secret.txt").write_text('{"secret": 1}')
        (nbs / "bad.ipynb").symlink_to(tmp_path / "secret.txt")
    elif case == "non-UTF-8":
        (nbs / "bad.ipynb").write_bytes(b'\xff\xfe{"cells"')
    else:
        os.mkfifo(nbs / "bad.ipynb")
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "lab", "--dry-run", *(["--student"] * student)])
    assert "Traceback" not in err and "raised" not in str(rc), (rc, err)
    if rc != 0:
        one_line_error(rc, err)
    copies = list((tmp_path / "res").rglob("bad.ipynb"))
    assert all("secret" not in p.read_text(errors="replace") for p in copies if p.is_file())


def test_lab_copies_a_notebook_named_with_escapes_and_prints_nothing_raw(tmp_path):  # held
    root = root_copy(tmp_path)
    (root / "notebooks" / "ev\x1b[2Jil.ipynb").write_bytes((root / "notebooks" / "tiny.ipynb").read_bytes())
    for student in ([], ["--student"]):
        rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "lab", "--dry-run", *student])
        assert rc == 0 and _clean(out + err), repr(out + err)


# ================================================================================ (6) a roster the server edits
@pytest.mark.parametrize("edit", ["one user left out", "records reversed", "a user renumbered", "a key repeated"])
def test_secagg_a_roster_edited_for_one_client_aborts_or_sums_exactly(edit):  # held
    from test_probe42k import _secagg_round

    from fedlab_nb.methods.privacy.secure_aggregation import _ID, SecAggAbort
    width = _ID.size + 64  # a roster record: the id and two 32-byte public keys

    def change(at, m):
        if at != "roster":
            return m
        recs = [m[i:i + width] for i in range(0, len(m), width)]
        if edit == "one user left out":
            recs = recs[:3]
        elif edit == "records reversed":
            recs = recs[::-1]
        elif edit == "a user renumbered":
            recs[3] = _ID.pack(7) + recs[3][_ID.size:]
        else:
            recs[3] = recs[3][:_ID.size] + recs[2][_ID.size:]
        return b"".join(recs)
    try:
        x, total = _secagg_round(tamper_server=change)
    except SecAggAbort:
        return
    assert np.array_equal(total, x.sum(0).astype(np.uint64))


# ================================================================================ (8) history of odd numbers
@pytest.mark.parametrize("rows", ["1,inf,5\n", "1,1e400,5\n", "1,1e308,1\n2,1e308,1\n"], ids=["inf", "1e400", "sum"])
def test_history_with_infinite_byte_counts_is_one_line(tmp_path, rows):
    (tmp_path / "h.csv").write_text("round,bytes_up,bytes_down\n" + rows)
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert "raised" not in str(rc), rc
    if rc != 0:
        one_line_error(rc, err)


@pytest.mark.parametrize("last", ["-2", "1e999"], ids=["negative", "infinite"])
def test_history_does_not_report_an_invalid_epsilon_as_a_guarantee(tmp_path, last):
    (tmp_path / "h.csv").write_text(f"round,test_acc,epsilon,dp_delta\n1,0.5,1,1e-5\n2,0.6,{last},1e-5\n")
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    assert "raised" not in str(rc) and not ("epsilon = -" in out or "epsilon = inf" in out), (rc, out)


@pytest.mark.parametrize("csv", ["round,bytes_up\n1,5\n", "round,test_acc\n1,\x1b[2J\n", "",
                                 "round,bytes_up,bytes_down\n1,-x,5\n"],
                         ids=["no bytes_down", "escapes in a number column", "empty", "a bad integer"])
def test_history_odd_csvs_are_one_clean_line(tmp_path, csv):  # held
    (tmp_path / "h.csv").write_text(csv)
    rc, out, err = cli(["--root", root_copy(tmp_path), "history", tmp_path / "h.csv"])
    one_line_error(rc, err)
    assert _clean(out + err), repr(err)


# ================================================================================ (3) more links in results
def test_run_with_results_runs_a_link_is_refused_before_a_kernel(tmp_path):  # held
    root, results = _results(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (results / "runs").symlink_to(elsewhere)
    rc, out, err = cli(["--root", root, "--results", results, "run", "tiny"])
    one_line_error(rc, err)
    assert "link" in err and list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("name", ["REPORT.md", "index.html"])
def test_report_with_the_board_a_dangling_link_creates_nothing_at_its_target(tmp_path, name):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    (results / name).symlink_to(tmp_path / "target.txt")
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert "Traceback" not in err and "raised" not in str(rc), (rc, err)
    assert not (tmp_path / "target.txt").exists()


# ================================================================================ (7) write errors of other kinds
def _failing_writes(monkeypatch, number):
    """Every temporary file fails with errno `number` (28 ENOSPC, 122 EDQUOT, 13 EACCES, 5 EIO, 30 EROFS)."""
    import tempfile

    def fail(*a, **k):
        raise OSError(number, os.strerror(number))
    monkeypatch.setattr(tempfile, "mkstemp", fail)


@pytest.mark.parametrize("number", [28, 122, 13], ids=["ENOSPC", "EDQUOT", "EACCES"])
@pytest.mark.parametrize("cmd", [["report"], ["lab", "--dry-run"]], ids=["report", "lab"])
def test_write_errors_are_one_line(tmp_path, monkeypatch, number, cmd):  # held
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    _failing_writes(monkeypatch, number)
    rc, out, err = cli(["--root", root, "--results", results, *cmd])
    one_line_error(rc, err)


def test_an_io_error_while_writing_the_board_is_one_line(tmp_path, monkeypatch):
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    _failing_writes(monkeypatch, 5)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)


def test_a_read_only_file_system_gets_its_own_advice(tmp_path, monkeypatch):
    root, results = _results(tmp_path, **{"tiny-smoke.json": json.dumps(RESULT)})
    _failing_writes(monkeypatch, 30)
    rc, out, err = cli(["--root", root, "--results", results, "report"])
    one_line_error(rc, err)
    assert "read-only" in err and "free space" not in err, err


# ================================================================================ (6) Flower reply metrics
@pytest.mark.parametrize("over", [{"num-examples": 10 ** 30}, {"num-examples": True}, {"train-loss": "\x1b[2J"},
                                  {"train-loss": float("inf")}, {"steps": 10 ** 30}, {"bytes-up": -5}, {"zzz": 1}],
                         ids=["num-examples 1e30", "num-examples bool", "train-loss escapes", "train-loss inf",
                              "steps 1e30", "bytes-up negative", "an extra metric"])
def test_flower_reply_metric_variants_are_refused_naming_the_client(fed10, over):  # held
    from probes import flower_reply, flower_strategy
    s = flower_strategy(fed10)
    before = s.theta.clone()
    with pytest.raises(ValueError, match="client 0") as e:
        s.aggregate_train(1, [flower_reply(s, 0, **over), flower_reply(s, 1)])
    assert _clean(str(e.value)) and torch.equal(s.theta, before)


# ================================================================================ (4) requires never imported
@pytest.mark.parametrize("requires", ['["this.x"]', '["this"]', '["antigravity.x"]'])
def test_requires_entries_are_never_imported_by_list(tmp_path, requires):  # held
    import sys
    root = root_copy(tmp_path, lambda t: t.replace("notebook: notebooks/tiny.ipynb",
                                                   f"notebook: notebooks/tiny.ipynb\nrequires: {requires}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "list"])
    assert rc == 0 and "this" not in sys.modules and "antigravity" not in sys.modules
    assert "Beautiful is better" not in out + err


# ================================================================================ (1) the accountant at its edges
@pytest.mark.parametrize("target", [1e-300, 1e-3, 0.5, 8.0])
def test_noise_for_epsilon_meets_tiny_and_ordinary_targets(target):  # held
    from fedlab_nb.methods.privacy.accounting import epsilon, noise_for_epsilon
    z = noise_for_epsilon(target, 0.1, 10, 1e-5)
    assert np.isfinite(z) and z > 0 and epsilon(0.1, z, 10, 1e-5) <= target


@pytest.mark.parametrize("args", [(np.float32(0.1), 1.0, np.int64(10), np.float64(1e-5)), (0.1, 1.0, 10, 5e-324),
                                  (1e-320, 1.0, 10, 1e-5)], ids=["numpy scalars", "subnormal delta", "subnormal q"])
def test_epsilon_with_numpy_scalars_and_subnormals_is_finite(args):  # held
    from fedlab_nb.methods.privacy.accounting import epsilon
    assert np.isfinite(epsilon(*args)) and epsilon(*args) >= 0


@pytest.mark.parametrize("args", [(0.1, 1.0, 10.0, 1e-5), (1.0000000000000002, 1.0, 10, 1e-5), (0.1, 1.0, 10, 1.0)],
                         ids=["float steps", "q just above 1", "delta 1"])
def test_epsilon_refuses_near_miss_arguments(args):  # held
    from fedlab_nb.methods.privacy.accounting import epsilon
    with pytest.raises(ValueError):
        epsilon(*args)


# ================================================================================ (5)/(8) figures check on odd run data
EVIL = "\x1b[2J\u202e\u2028k"
SERIES = [{"key": "a", "kind": "line", "values": [1, 9]}]
RUN_DATA = {"key with escapes": ("main", {"figure": "main", "series": [{**SERIES[0], "key": EVIL}]}),
            "file named with escapes": (f"m{EVIL}", {"figure": "main", "series": SERIES}),
            "a value beyond double": ("main", '{"figure":"main","series":[{"key":"a","kind":"line",'
                                              '"values":[1e400,2]}]}'),
            "a string value": ("main", {"figure": "main", "series": [{**SERIES[0], "values": [EVIL, 2]}]}),
            "deep nesting": ("main", '{"figure":"main","series":' + "[" * 100000 + "]" * 100000 + "}")}


@pytest.mark.parametrize("case", list(RUN_DATA))
def test_figures_check_with_odd_run_data_is_clean(tmp_path, case):  # held
    root = root_copy(tmp_path)
    good, run = tmp_path / "good", tmp_path / "run"
    good.mkdir(), run.mkdir()
    (good / "main.data.json").write_text(json.dumps({"figure": "main", "series": [{"key": "a", "kind": "line",
                                                                                   "values": [1.0, 2.0]}]}))
    assert cli(["--root", root, "figures", "update", "tiny", "--from", good])[0] == 0
    name, data = RUN_DATA[case]
    (run / f"{name}.data.json").write_text(data if isinstance(data, str) else json.dumps(data))
    rc, out, err = cli(["--root", root, "figures", "check", "tiny", "--from", run])
    assert rc == 1 and "Traceback" not in err and "raised" not in str(rc) and _clean(out + err), (rc, repr(out + err))


# ================================================================================ (8) an infinite default
def test_run_with_an_infinite_notebook_default_is_one_line(tmp_path):
    root = root_copy(tmp_path)
    path = root / "notebooks" / "tiny.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"][1]["source"] = "".join(nb["cells"][1]["source"]) + "\nvalue = 1e400"
    path.write_text(json.dumps(nb))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny"])
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)


def test_run_with_an_infinite_scale_override_is_one_line(tmp_path):  # held
    root = root_copy(tmp_path, lambda t: t.replace("{n_points: 4}", "{n_points: 4, value: .inf}"))
    rc, out, err = cli(["--root", root, "--results", tmp_path / "res", "run", "tiny"])
    assert "raised" not in str(rc), rc
    one_line_error(rc, err)
