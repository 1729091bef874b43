"""Helpers shared by the issue-42 probe files (tests/test_probe42*.py): a tiny repository copy, the CLI run
in-process, the probe-finding marker and the small federation the DP and Flower probes train on."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlab_nb as fl

KW = dict(model="logreg", local_epochs=1, batch_size=8, lr=0.1, progress=False)
TINY = Path(__file__).parent / "data" / "tinyroot"
REPO = Path(__file__).resolve().parents[1]


def finding(why):
    return pytest.mark.xfail(strict=True, reason=f"probe finding: {why}")


def numbered_finding(n, why):
    return pytest.mark.xfail(strict=True, reason=f"finding {n}: {why}")


def script(path):
    """A script of the repository (scripts/*.py, benchmarks/*.py) imported as a module, not run."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fed10():
    return fl.federate("digits", "iid", n_clients=10, seed=0)


def root_copy(tmp_path, edit=None):
    """A copy of tests/data/tinyroot (one paper, `tiny`), its claims file optionally edited."""
    root = tmp_path / "root"
    shutil.copytree(TINY, root)
    if edit is not None:
        p = root / "papers" / "tiny.yaml"
        p.write_text(edit(p.read_text()))
    return root


def cli(args):
    """(exit status, stdout, stderr) of main(); SystemExit (argparse) is an exit status, another exception is
    returned as text (a traceback is the finding, and the caller's checks fail on it)."""
    from fedlab_nb.cli import main
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    except Exception as e:  # noqa: BLE001 -- a traceback is the finding
        return f"raised {type(e).__name__}: {str(e)[:200]}", out.getvalue(), err.getvalue()
    return rc, out.getvalue(), err.getvalue()


# what a printed line must never hold: escapes, BEL, bidi overrides / isolates, C1 CSI, CR, separators, BOM
CONTROL = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b", "\r", "\u2028", "\u200f", "\x85", "\u061c", "\ufeff")
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
RESULT = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "metrics": {"value": 1.0},
          "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline"}]}


def clean(text):
    return not any(c in text for c in CONTROL)


def no_traceback(rc, err):
    assert rc in (0, 1) and "Traceback" not in err and "raised" not in str(rc), (rc, err)


def interrupted_dp_run(fed, checkpoint, **privacy):
    """A 4-round DP-FedAvg run (its own Poisson sampler) stopped by an interrupt after round 2, leaving its
    checkpoint: what the resume probes start from."""
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler

    def stop(r, theta, row):
        if r == 2:
            raise KeyboardInterrupt
    method, sampler = dp_fedavg_with_sampler(fed, **privacy)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(method, fed, rounds=4, clients_per_round=sampler, seed=0, checkpoint=checkpoint, callback=stop,
                    **KW)


def one_line_error(rc, err):
    assert rc in (1, 2) and "Traceback" not in err and len(err.strip().splitlines()) == 1, (rc, err)


def declared(sampler, q, sampling="poisson"):
    """A custom sampler function that says how it samples, as DP needs before round 1 (dp.check_sampler); the
    run still checks it against the clients it picks."""
    sampler.sampling, sampler.sampling_rate = sampling, q
    return sampler


def sampling_check_run(K, q, sampling, pick, rounds, seed=0, drawn=False):
    """The round at which DPAggregate's sampling check refuses `pick` (1-based), or None when it never does;
    `drawn`: the ids are the sampler's whole draws (what the engine passes), not the clients left after drops."""
    from fedlab_nb.methods.privacy.dp import DPAggregate
    rule = DPAggregate(noise_multiplier=1.0, clip_norm=1.0, sampling_rate=q, sampling=sampling)
    state, g = rule.init_state(torch.zeros(3), K), np.random.default_rng(seed)
    for r in range(rounds):
        ids = np.sort(pick(r, K, g))
        try:
            rule._check_sampling(state, len(ids), ids, drawn)
        except ValueError:
            return r + 1
    return None


def trace(method, fed, sampler, rounds, **kw):
    """(History, θ after every round) of a short run."""
    seen = []
    h = fl.simulate(method, fed, rounds=rounds, clients_per_round=sampler, seed=0,
                    callback=lambda r, theta, row: seen.append(theta.clone()), **{**KW, **kw})
    return h, seen


def flower_strategy(fed, **kw):
    """A MethodStrategy in the middle of round 1 (clients 0-2 sampled, node ids 100 + k), for the reply probes."""
    pytest.importorskip("flwr")
    from fedlab_nb.flower import MethodStrategy, _setup
    s = MethodStrategy(_setup("fedavg", fed, "logreg", rounds=1, clients_per_round=3, **kw))
    s.nodes, s.sampled, s._t0 = {k: 100 + k for k in range(fed.num_clients)}, np.array([0, 1, 2]), 0.0
    s.down, s.theta_bytes = {"theta": s.theta}, 0
    return s


def flower_reply(s, k, delta=None, **metrics):
    """A Flower reply of client k in round 1 (a stand-in for flwr's Message), its metrics overridable; `steps` is
    what client k runs in round 1 (the server checks it)."""
    from types import SimpleNamespace

    from flwr.app import Array
    delta = np.full(s.theta.numel(), 0.01, np.float32) if delta is None else delta
    honest = s._steps_run(0, k) if type(k) is int and 0 <= k < s.s.num_clients else 1
    metrics = {"client-id": k, "num-examples": 10, "steps": honest, "train-loss": 0.5, "bytes-up": 400, **metrics}
    return SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(src_node_id=100 + k),
                           content={"metrics": metrics, "message": {"delta": Array(delta)}})


def journal_unlink_fails(monkeypatch):
    """Removing a publish journal (repro.files.JOURNAL) fails with EIO; every other unlink works."""
    import errno
    from pathlib import Path

    from fedlab_nb.repro import files
    real = Path.unlink

    def unlink(self, *a, **k):
        if self.name == files.JOURNAL:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "unlink", unlink)


def registered_methods(flower: bool = False) -> list[str]:
    """The registered methods a bare factory call builds (no model or data of their own); `flower`: only those the
    Flower adapter runs."""
    import fedlab_nb.methods  # noqa: F401 (registers every method)
    from fedlab_nb.core.registry import REGISTRY
    out = []
    for name, entry in sorted(REGISTRY.items()):
        if entry.kind != "method":
            continue
        try:
            method = entry.factory()
        except (TypeError, ValueError):  # needs a model or data of its own
            continue
        if isinstance(method, fl.Method) and (not flower or getattr(method, "flower_compatible", True)):
            out.append(name)
    return out
