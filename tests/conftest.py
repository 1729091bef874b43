import os
import tempfile

# Small tensors: one thread is faster and steadier than two on a shared 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the publish journal's signing key (repro.files._journal_key) lives here during the tests, not in the user's home
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="fedlab-nb-state-"))

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


@pytest.fixture(scope="session")
def digits_fed():
    import fedlab_nb as fl
    return fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0, min_size=20)


@pytest.fixture
def fused_steps(monkeypatch):
    """A list that gets one entry per call of the fused step (engine/fused.py `sgd_step_`)."""
    from fedlab_nb.engine import fused
    calls, real = [], fused.sgd_step_
    monkeypatch.setattr(fused, "sgd_step_", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
