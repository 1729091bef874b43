"""Probe 42v: a twenty-second, independent re-run of issue 42's failure classes, aimed at the code changed last: the
Flower server's step check (`MethodStrategy._steps_run`) against honest clients of every registered method and of
other local-training shapes (local_steps, several tracks, own training), and dishonest step counts; DPAggregate's
need for the whole draw (RoundInfo.sampled); the new "rested after a round" sampling test (fair Poisson and
fixed-size samplers at many K, q and seeds, and samplers that rest a client two or three rounds later, only some
clients, or at odd rounds only); the journal's `.kept` warnings (planted files, links, thousands of folders, control
characters), `check_sampled`'s answer and run folder names. Each test asserts the correct behaviour; a test marked
xfail(strict=True) is an open finding (its reason says what is wrong), so the suite stays green until it is fixed."""
import numpy as np
import pytest
import torch

from probes import cli, fed10, root_copy, sampling_check_run  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_
from probes import CONTROL, flower_reply, registered_methods


def _strategy(fed, name, **kw):
    """A MethodStrategy for method `name` in the middle of round 1 (clients 0-2 sampled, node ids 100 + k)."""
    pytest.importorskip("flwr")
    from fedlab_nb.flower import MethodStrategy, _setup
    kw = {"clients_per_round": 3, **kw}
    s = MethodStrategy(_setup(name, fed, "logreg", rounds=2, batch_size=8, **kw))
    s.nodes, s.sampled, s._t0 = {k: 100 + k for k in range(fed.num_clients)}, np.array([0, 1, 2]), 0.0
    s.down, s.theta_bytes = s.s.method.broadcast(s.state, s.theta), 0
    return s


def _client_steps(s, k, r=0):
    """What the ClientApp's train reports as `steps` for client k in round r (flower._client_app, run in-process)."""
    from fedlab_nb.engine.server import client_round
    from fedlab_nb.engine.store import ClientStore
    dev = s.s.fed.device
    cstate = ClientStore(s.s.method.client_state(s.s.theta0, s.s.round.groups), 1, dev).gather([0], dev)
    entries, cstate, losses, jobs = client_round(s.s.round, r, np.array([k]), s.down, cstate)
    return len(jobs[0].batches)


# ================================================================================ (A) honest clients, every shape
@pytest.mark.parametrize("shape", [{}, {"local_steps": 3}, {"local_epochs": 2}], ids=["E=1", "local_steps=3", "E=2"])
def test_every_methods_honest_client_reports_the_steps_the_server_expects(fed10, shape):  # held
    wrong = {}
    for name in registered_methods(flower=True):
        try:
            s = _strategy(fed10, name, **shape)
        except (TypeError, ValueError):  # needs another model or data
            continue
        for k in (0, 2):
            try:
                told, expected = _client_steps(s, k), s._steps_run(0, k)
            except (TypeError, ValueError, KeyError, RuntimeError):
                continue
            if told != expected:
                wrong[name] = (k, told, expected)
    assert not wrong, wrong


def test_a_dp_methods_honest_client_reports_the_steps_the_server_expects(fed10):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.3)
    s = _strategy(fed10, method, local_steps=2, clients_per_round=sampler)
    s.sampled = np.array([0, 1, 2])
    assert [_client_steps(s, k) for k in (0, 1, 2)] == [s._steps_run(0, k) for k in (0, 1, 2)]


# ================================================================================ (A) dishonest step counts
@pytest.mark.parametrize("steps", ["off by +1", "off by -1", "a string", "None", "a list", "nan"])
@pytest.mark.parametrize("name", ["fednova", "fedgp"])
def test_a_reply_with_steps_not_its_schedule_is_refused_naming_the_client(fed10, name, steps):  # held
    s = _strategy(fed10, name, local_steps=3)
    honest = s._steps_run(0, 0)
    value = {"off by +1": honest + 1, "off by -1": honest - 1, "a string": str(honest), "None": None,
             "a list": [honest], "nan": float("nan")}[steps]
    before = s.theta.clone()
    with pytest.raises(ValueError, match="client 0|node 100"):
        s.aggregate_train(1, [flower_reply(s, 0, steps=value), flower_reply(s, 1)])
    assert torch.equal(s.theta, before)


@pytest.mark.parametrize("value", [3.0, 3], ids=["float", "int"])  # what a MetricRecord carries
def test_an_honest_step_count_of_another_number_type_is_accepted(fed10, value):  # held
    s = _strategy(fed10, "fednova", local_steps=3)
    assert s._steps_run(0, 0) == 3
    s.aggregate_train(1, [flower_reply(s, 0, steps=value), flower_reply(s, 1)])
    assert torch.isfinite(s.theta).all()


def test_a_reply_with_the_steps_of_a_longer_track_is_refused(fed10):  # held (ditto: personal track counted)
    s = _strategy(fed10, "ditto", local_steps=2)
    with pytest.raises(ValueError, match="client 0"):
        s.aggregate_train(1, [flower_reply(s, 0, steps=s._steps_run(0, 0) * 2), flower_reply(s, 1)])


# ================================================================================ (A) the whole draw, every engine path
def test_dp_aggregate_without_the_draw_is_refused_naming_the_fix():  # held
    from fedlab_nb.core.method import RoundInfo
    from fedlab_nb.methods.privacy.dp import DPAggregate
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.3)
    info = RoundInfo(0, np.empty(0, np.int64), torch.zeros(0), torch.zeros(0), 10, 0.1, torch.zeros(3), None, 0)
    with pytest.raises(ValueError, match="sampled=<the draw>"):
        rule.aggregate(rule.init_state(torch.zeros(3), 10), torch.zeros(0, 3), torch.zeros(0), info=info)


@pytest.mark.parametrize("engine", ["simulate", "resume", "flower", "flower, nobody drawn"])
def test_every_engine_path_gives_dp_the_whole_draw(fed10, tmp_path, engine):  # held (simulate_seeds refuses DP)
    import fedlab_nb as fl
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    from probes import KW, interrupted_dp_run
    priv = dict(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.2)
    if engine == "resume":
        interrupted_dp_run(fed10, tmp_path / "ck.pt", **priv)
    method, sampler = dp_fedavg_with_sampler(fed10, **priv)
    if engine.startswith("flower"):
        s = _strategy(fed10, method, clients_per_round=sampler)
        s.sampled = np.array([], np.int64) if "nobody" in engine else np.array([0, 1])
        before = s.theta.clone()
        s.aggregate_train(1, [flower_reply(s, int(k)) for k in s.sampled])
        assert not torch.equal(s.theta, before) and torch.isfinite(s.theta).all()
        return
    kw = {"checkpoint": tmp_path / "ck.pt"} if engine == "resume" else {}
    h = fl.simulate(method, fed10, seed=0, rounds=4, clients_per_round=sampler, **KW, **kw)
    assert np.isfinite(np.asarray(h.epsilon)).all(), h.epsilon


# ================================================================================ (B) fair samplers, many K and q
def _poisson(q):
    return lambda r, K, g: np.flatnonzero(g.random(K) < q)


def _fixed(q):
    return lambda r, K, g: g.choice(K, round(q * K), replace=False)


@pytest.mark.parametrize("K, q, rounds", [(2, 0.5, 300), (3, 0.99, 200), (10, 0.01, 300), (10, 0.1, 300),
                                          (50, 0.3, 200), (1000, 0.01, 60), (7, 0.9, 200), (100, 0.99, 60),
                                          (4, 0.25, 300)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_fair_poisson_sampler_is_never_refused(K, q, rounds, seed):  # held
    assert sampling_check_run(K, q, "poisson", _poisson(q), rounds, seed=seed, drawn=True) is None


@pytest.mark.parametrize("K, q, rounds", [(2, 0.5, 300), (10, 0.1, 300), (50, 0.3, 200), (1000, 0.01, 60),
                                          (10, 0.9, 200), (100, 0.99, 60), (4, 0.25, 300), (5, 0.2, 300)])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_fair_fixed_size_sampler_is_never_refused(K, q, rounds, seed):  # held
    assert sampling_check_run(K, q, "fixed", _fixed(q), rounds, seed=seed, drawn=True) is None


# ================================================================================ (B) resting a client, other ways
def _resting(gap, rate=0.43, who=None, sampling="poisson"):
    """A sampler (K = 10, declared q = 0.3) that keeps a client of `who` (all by default) out of the round `gap`
    rounds after one it took part in, drawing the others at `rate` (Poisson) or 3 of the available (fixed)."""
    drawn = {}

    def pick(r, K, g):
        resting = set(drawn.get(r - gap, [])) & (set(range(K)) if who is None else set(who))
        available = np.array([k for k in range(K) if k not in resting])
        if sampling == "fixed":
            ids = np.sort(g.choice(available, 3, replace=False))
        else:
            rates = np.array([rate if who is None or k in who else 0.3 for k in available])
            ids = available[g.random(len(available)) < rates]
        drawn[r] = ids.tolist()
        return ids
    return pick


# finding 1 (class 1: ε not valid; medium: it takes a custom sampler that declares itself Poisson or fixed): the new
# "rested after a round" test (sampling_tests._rested_after_a_round) counts clients in both rounds of ADJACENT round
# pairs only, and counts them over all clients together, so the cool-down of the twenty-first probe's finding 8 passes
# 300 rounds unrefused (three seeds) when it rests a client two or three rounds after it took part instead of one, when
# a fixed-size sampler (3 of 10) does so, or when only 3 of 10 clients are rested (after each round, at 0.43) and the
# others are drawn fairly: each rested client is drawn at 0.43 in the rounds it can be drawn in, so, as in finding 8,
# the reported ε (24.5 after 100 rounds, z = 1, δ = 1e-5) is below what the same accountant gives those clients (29.4)
# (fixed: sampling_tests._rested_after_a_round counts, per client and over all clients, the disjoint round pairs
# (t, t + ℓ) for ℓ = 1 … 8; the first three are refused at round 64. Resting only 3 of 10 clients is refused at
# round 768 (test below), not within 300: a client's 150 lag-1 pairs at q² = 9 % hold it twice in none with
# probability 0.91^150 = 7e-7, too likely for a test that refuses a fair sampler at most once in 10⁹ checks)
@pytest.mark.parametrize("how", ["two rounds later", "three rounds later", "fixed size, two rounds later",
                                 pytest.param("only 3 of 10 clients", marks=F_(1, "3 rested clients of 10 need "
                                                                              "about 770 rounds to be told apart"))])
def test_a_sampler_resting_clients_in_other_ways_is_refused(how):
    pick, sampling = {"two rounds later": (_resting(2), "poisson"), "three rounds later": (_resting(3), "poisson"),
                      "fixed size, two rounds later": (_resting(2, sampling="fixed"), "fixed"),
                      "only 3 of 10 clients": (_resting(1, who={0, 1, 2}), "poisson")}[how]
    assert sampling_check_run(10, 0.3, sampling, pick, 300, drawn=True) is not None


def test_resting_only_some_clients_is_refused_in_a_longer_run():
    assert sampling_check_run(10, 0.3, "poisson", _resting(1, who={0, 1, 2}), 1000, drawn=True) is not None


def test_the_cool_down_after_one_round_is_still_refused():  # held (the twenty-first probe's finding 8)
    assert sampling_check_run(10, 0.3, "poisson", _resting(1), 300, drawn=True) is not None


def test_the_epsilon_a_client_rested_two_rounds_later_gets_is_above_the_reported_one():  # held (finding 1's arithmetic)
    from fedlab_nb.methods.privacy import accounting
    # two rounds later: a client is available in 1 - q = 70 % of rounds, and drawn at 0.3 / 0.7 = 0.43 there
    assert accounting.epsilon(0.43, 1.0, 70, 1e-5) > 1.15 * accounting.epsilon(0.3, 1.0, 100, 1e-5)


# ================================================================================ (C) planted .kept and journals
def _results(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root, results = root_copy(tmp_path), tmp_path / "results"
    results.mkdir()
    return root, results


def _list(root, results):
    return cli(["--root", root, "--results", results, "list"])


# finding 2 (OUT-OF-CLASS, low): files.mention_kept names every entry matching `.*.*.kept` in the results folder as
# "holds earlier versions a run killed while it published left ... move what you want back by hand, then remove that
# folder", whatever it is: a regular file, a link to /etc (a user following the advice with `rm -r name/` or `mv
# name/* .` acts on /etc), or the folder of no paper of the repository; only a folder _retire made (a real directory,
# not a link, of a known paper's stem) should be named so
# (fixed: mention_kept names only real folders (not links or files) of a paper's stem (files._retired_folder))
@pytest.mark.parametrize("kind", ["a regular file", "a link to /etc"])
def test_a_planted_kept_entry_that_is_no_folder_is_not_announced_as_earlier_versions(tmp_path, monkeypatch, kind):
    root, results = _results(tmp_path, monkeypatch)
    planted = results / ".tiny-smoke.abc.kept"
    if kind == "a regular file":
        planted.write_text("x")
    else:
        planted.symlink_to("/etc")
    rc, out, err = _list(root, results)
    assert rc == 0 and "earlier versions" not in err, err


# finding 3 (OUT-OF-CLASS, low): every reader (list, report, each run) prints one warning per `.kept` folder and per
# staging folder holding an unsigned journal, with no bound: 1,000 planted `.tiny-smoke.<n>.running/publishing.json`
# (or 3,000 empty `.tiny-smoke.<n>.kept` folders) make every `list` print 1,000 (3,000) warning lines and take 2-5 s
# on this machine; a results folder someone hands over buries the listing (one summary line past a few would do)
# (fixed: kept and unsigned folders are named in one warning line each (files._some))
@pytest.mark.parametrize("what", ["unsigned journals", "kept folders"])
def test_thousands_of_planted_staging_folders_keep_list_short(tmp_path, monkeypatch, what):
    from fedlab_nb.repro import files
    root, results = _results(tmp_path, monkeypatch)
    for i in range(300):
        folder = results / f".tiny-smoke.{i:04d}.{'running' if what == 'unsigned journals' else 'kept'}"
        folder.mkdir()
        if what == "unsigned journals":
            (folder / files.JOURNAL).write_text('{"entries": []}')
    rc, out, err = _list(root, results)
    assert rc == 0 and len(err.splitlines()) <= 20, len(err.splitlines())


@pytest.mark.parametrize("name", [".tiny-smoke.a\x1b[2Jb.kept", ".tiny-smoke.\u202eab.kept", ".tiny-smoke.a\nb.kept",
                                  ".tiny-smoke.a\x9bb.kept", ".tiny-smoke.\u2028x.kept"],
                         ids=["escape", "bidi", "newline", "C1 CSI", "line separator"])
def test_a_kept_folder_name_with_control_characters_is_printed_escaped(tmp_path, monkeypatch, name):  # held
    from probes import clean
    root, results = _results(tmp_path, monkeypatch)
    (results / name).mkdir()
    rc, out, err = _list(root, results)
    assert rc == 0 and clean(err) and all(line.startswith("warning: ") for line in err.splitlines()), repr(err)


@pytest.mark.parametrize("name", [".tiny-smoke.a\x1b[2Jb.running", ".tiny-smoke.\u202eab.running",
                                  ".tiny-smoke.a\nb.running"], ids=["escape", "bidi", "newline"])
def test_an_unsigned_journal_in_a_folder_of_control_characters_is_printed_escaped(tmp_path, monkeypatch, name):  # held
    from probes import clean
    from fedlab_nb.repro import files
    root, results = _results(tmp_path, monkeypatch)
    (results / name).mkdir()
    (results / name / files.JOURNAL).write_text('{"entries": []}')
    rc, out, err = _list(root, results)
    assert rc == 0 and clean(err) and all(line.startswith("warning: ") for line in err.splitlines()), repr(err)
    assert (results / name / files.JOURNAL).exists()  # never followed, never deleted


def test_a_planted_unsigned_journal_naming_files_moves_nothing(tmp_path, monkeypatch):  # held
    import json

    from fedlab_nb.repro import files
    root, results = _results(tmp_path, monkeypatch)
    (results / "tiny-smoke").mkdir()
    victim = results / "tiny-smoke" / "metrics.json"
    victim.write_text("{}")
    stage = results / ".tiny-smoke.zz.running"
    stage.mkdir()
    (stage / files.JOURNAL).write_text(json.dumps({"entries": [["tiny-smoke/metrics.json", "moved"]], "sig": "0" * 64}))
    _list(root, results)
    assert victim.read_text() == "{}" and stage.is_dir()


# ================================================================================ (C) the key: races, odd homes
def test_threads_making_the_key_at_once_agree_on_one(tmp_path, monkeypatch):  # held
    from concurrent.futures import ThreadPoolExecutor

    from fedlab_nb.repro import files
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: files._journal_key(), range(32)))
    assert len(set(keys)) == 1 and keys[0] is not None and len(keys[0]) == 32


# finding 5 (class 7, low: a file system without hard links, two runs making the key at once): _make_key's fallback
# when os.link fails is "if not path.exists(): os.replace(tmp, path)", a check then a replace, so a second process
# that checked before the first replaced overwrites the key the first one already read and signed its journal with;
# that run's journal is then "not signed with your key", and a kill during its publish is not undone (a warning
# only). Confirmed by hand: 8 threads making a fresh key with os.link failing got two different keys in 5 of 300
# tries; here the interleaving is replayed (the second maker's check saw no key)
# (fixed: without hard links the key is created in place with O_EXCL (files._make_key_in_place), never replaced; a reader waits out a half-written one)
def test_a_key_made_without_hard_links_is_never_replaced_by_a_second_maker(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    from fedlab_nb.repro import files

    def no_links(*a, **k):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(os, "link", no_links)
    first = files._journal_key()  # the first run's key, which signs its journal
    path = tmp_path / "state" / "fedlab_nb" / "journal.key"
    real = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self, *a, **k: False if self == path else real(self, *a, **k))
    files._make_key(path)  # the second run, whose `not path.exists()` ran before the first one's replace
    monkeypatch.setattr(Path, "exists", real)
    assert first is not None and files._journal_key() == first


@pytest.mark.parametrize("mode", [0o500, 0o000, 0o777])
def test_a_state_folder_of_odd_permissions_never_blocks_a_publish(tmp_path, monkeypatch, mode):  # held
    import os

    from test_probe42r import _stand_in
    if os.geteuid() == 0 and mode != 0o777:
        pytest.skip("root ignores folder modes")
    root, results = _results(tmp_path, monkeypatch)
    state = tmp_path / "state" / "fedlab_nb"
    state.mkdir(parents=True)
    state.chmod(mode)
    _stand_in(monkeypatch)
    try:
        rc, out, err = cli(["--root", root, "--results", results, "reproduce", "tiny"])
    finally:
        state.chmod(0o700)
    assert rc == 0 and (results / "tiny-smoke").is_dir() and "Traceback" not in err, (rc, err)
    assert not list(results.glob(".*.running")), sorted(p.name for p in results.iterdir())


# ================================================================================ (C) run folder names, check_sampled
# finding 4 (OUT-OF-CLASS, low): runner._folder_text keeps the sign of U+2212, U+FE63 and U+FF0D only (MINUS_SIGNS),
# so a text value typed with the en dash a word processor's autocorrect puts for a minus ('–0.5', U+2013), or the
# figure dash U+2012 or hyphen U+2010, shows as value=0.5 in the run folder's name (the hash keeps the runs apart)
# (fixed: MINUS_SIGNS maps the hyphen, non-breaking hyphen, figure dash and en dash to '-' as well)
@pytest.mark.parametrize("dash", ["\u2013", "\u2012", "\u2010"], ids=["en dash", "figure dash", "hyphen"])
def test_a_run_folder_keeps_the_sign_of_other_dashes(tmp_path, dash):
    from fedlab_nb.repro.runner import run_folder
    folder = run_folder("tiny", "smoke", {"v": dash + "0.5"}, tmp_path, first=["v"])
    assert "v=0.5-" not in folder.name, folder.name


@pytest.mark.parametrize("value, shown", [("\uff0d0.5", "v=-0.5-"), ("\ufe63.5", "v=-.5-"), ("\t-2\n", "v=-2-"),
                                          ("\u22121e\u22125", "v=-1e-5-"), (".5e-3", "v=.5e-3-")],
                         ids=["fullwidth minus", "small minus dot", "tab newline", "minus exponent", "dot exponent"])
def test_a_run_folder_shows_the_number_a_text_value_holds(tmp_path, value, shown):  # held
    from fedlab_nb.repro.runner import run_folder
    assert shown in run_folder("tiny", "smoke", {"v": value}, tmp_path, first=["v"]).name


@pytest.mark.parametrize("ids", [[], (), range(0), np.array([], np.uint8), np.array([3, 1], np.uint16),
                                 torch.tensor([2, 0]), np.array([1, 2], np.int32), (4,)],
                         ids=["list", "tuple", "range", "empty uint8", "uint16", "tensor", "int32", "tuple of one"])
def test_check_sampled_always_answers_a_1d_int64_array(ids):  # held
    from fedlab_nb.engine.sampling import check_sampled
    out = check_sampled(ids, 5, 0)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.ndim == 1


# ================================================================================ (A) one real Flower run
@pytest.mark.flower
def test_a_real_flower_run_of_fednova_on_unequal_partitions_refuses_no_honest_client():  # held
    pytest.importorskip("flwr")
    import fedlab_nb as fl
    from fedlab_nb.flower import run_on_flower
    fed = fl.federate("digits", "dirichlet", n_clients=3, seed=0, alpha=0.5)
    assert len({len(y) for x, y in fed.client_train}) > 1  # unequal partitions: unequal step counts
    h = run_on_flower("fednova", fed, "logreg", rounds=2, clients_per_round=3, batch_size=8,
                      backend_config={"client_resources": {"num_cpus": 1}})
    loss = np.asarray(h.train_loss)
    assert h.meta["runtime"] == "flower-simulation" and len(loss) == 2 and np.isfinite(loss).all()


# ================================================================================ (B) the refusal, end to end
def _dp(fed):
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    return dp_fedavg_with_sampler(fed, noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.3)[0]


def test_simulate_refuses_a_cool_down_sampler_naming_the_fix(fed10):  # held
    import fedlab_nb as fl
    from probes import KW, declared
    with pytest.raises(ValueError, match="dp_sampler"):
        fl.simulate(_dp(fed10), fed10, rounds=100, clients_per_round=declared(_resting(1), 0.3), seed=0,
                    **{**KW, "local_steps": 1})


def test_a_cool_down_sampler_is_still_refused_after_a_resume(fed10, tmp_path):  # held (the state keeps `repeats`)
    import fedlab_nb as fl
    from probes import KW, declared
    sampler, run = declared(_resting(1), 0.3), {**KW, "local_steps": 1}

    def stop(r, theta, row):
        if r == 20:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(_dp(fed10), fed10, rounds=100, clients_per_round=sampler, seed=0, checkpoint=tmp_path / "c.pt",
                    callback=stop, **run)
    with pytest.raises(ValueError, match="rests a client"):
        fl.simulate(_dp(fed10), fed10, rounds=100, clients_per_round=sampler, seed=0, checkpoint=tmp_path / "c.pt",
                    **run)


# ================================================================================ (B) other timing patterns
def _burst(r, K, g):
    """Rest everyone in odd rounds, draw each client at 0.6 in even ones (the same mean rate 0.3)."""
    return np.flatnonzero(g.random(K) < 0.6) if r % 2 == 0 else np.empty(0, np.int64)


def _odd_rounds_cool_down():
    last = []

    def pick(r, K, g):
        nonlocal last
        available = np.array([k for k in range(K) if not (r % 2 == 1 and k in last)])
        ids = available[g.random(len(available)) < (0.43 if r % 2 == 1 else 0.3)]
        last = ids.tolist()
        return ids
    return pick


@pytest.mark.parametrize("how", ["rest then burst", "cool-down in odd rounds only"])
def test_a_sampler_that_changes_at_odd_rounds_is_refused(how):  # held
    pick = _burst if how == "rest then burst" else _odd_rounds_cool_down()
    assert sampling_check_run(10, 0.3, "poisson", pick, 300, drawn=True) is not None


# ================================================================================ (A) DP on Flower, every reply dropped
def test_dp_on_flower_with_every_reply_non_finite_and_dropped_still_releases_noise(fed10):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=1.0, sampling_rate=0.2)
    s = _strategy(fed10, method, clients_per_round=sampler, on_nonfinite="drop")
    s.sampled, before = np.array([0, 1]), s.theta.clone()
    nan = np.full(s.theta.numel(), np.nan, np.float32)
    s.aggregate_train(1, [flower_reply(s, 0, delta=nan), flower_reply(s, 1, delta=nan)])
    assert torch.isfinite(s.theta).all() and not torch.equal(s.theta, before)


# ================================================================================ (C) an odd state home in warnings
@pytest.mark.parametrize("home", ["st\x1b[2Jate", "st\u202eate", "st\nate"], ids=["escape", "bidi", "newline"])
def test_a_state_home_with_control_characters_is_printed_escaped(tmp_path, monkeypatch, home):  # held
    from probes import clean
    from fedlab_nb.repro import files
    root, results = _results(tmp_path, monkeypatch)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / home))
    (results / ".tiny-smoke.q.running").mkdir()
    (results / ".tiny-smoke.q.running" / files.JOURNAL).write_text('{"entries": []}')
    rc, out, err = _list(root, results)
    assert rc == 0 and "not signed" in err, err
    assert clean(err) and all(line.startswith("warning: ") for line in err.splitlines()), repr(err)


# ================================================================================ (C) _retire's rename refused
@pytest.mark.parametrize("errno_name", ["EACCES", "ENOTEMPTY", "EXDEV", "EROFS"])
def test_a_retire_refused_for_any_reason_keeps_every_old_version_and_says_so_each_time(tmp_path, monkeypatch,
                                                                                      errno_name):  # held
    import errno
    import os

    from test_probe42u import _state, _strand, _undo_patches
    _state(monkeypatch, tmp_path / "state")
    root, results, before, stage = _strand(tmp_path, monkeypatch)
    _undo_patches(monkeypatch, keep_env=True)
    (results / "tiny-smoke" / "mine.txt").write_text("added by hand meanwhile")
    real = os.rename

    def rename(src, dst, *a, **k):
        if str(dst).endswith(".kept"):
            raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)), str(dst))
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, "rename", rename)
    for _ in range(2):
        rc, out, err = _list(root, results)
        assert rc == 0 and stage.name in err and "Traceback" not in err, err
    seen = {p.read_bytes() for p in results.rglob("*") if p.is_file()}
    assert all(data in seen for data in before.values())
