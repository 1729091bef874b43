"""The round's rows matrix (engine/rows.py): reused across rounds only when nothing else can see it, and a run
that reuses it computes exactly what a run on fresh memory does."""
import dataclasses

import numpy as np
import pytest
import torch

from fedlab_nb.core import weighted_mean
from fedlab_nb.engine import batched, rows, train_clients_loop
from fedlab_nb.engine.rows import RoundRows
from fedlab_nb.engine.server import simulate
from fedlab_nb.methods import get_method

LIKE = torch.zeros(5)


def _reused(hold, m_next: int = 4, like_next: torch.Tensor = LIKE) -> bool:
    """Does the second take() hand out the first one's memory while `hold(first)` is alive?"""
    kept = RoundRows()
    first = kept.take("w", 4, LIKE)
    where = first.untyped_storage().data_ptr()
    held = hold(first)  # noqa: F841  (alive until the second take)
    del first
    return kept.take("w", m_next, like_next).untyped_storage().data_ptr() == where


HOLDERS = {
    "a list": lambda a: [a],
    "a dict": lambda a: {"delta": a},
    "a row view": lambda a: a[1],
    "a flat view": lambda a: a.reshape(-1),
    "the transpose": lambda a: a.T,
    "a detached alias": lambda a: a.detach(),
    "a NumPy array": lambda a: a.numpy(),
    "its storage": lambda a: a.untyped_storage(),
    "an autograd graph": lambda a: (a * torch.ones(5, requires_grad=True)).sum(),
}


@pytest.mark.parametrize("how", HOLDERS)
def test_rows_someone_holds_are_not_handed_out_again(how):
    assert not _reused(HOLDERS[how])


def test_rows_nobody_holds_are_handed_out_again():
    assert _reused(lambda a: None)
    assert _reused(lambda a: a.clone())           # copies do not alias
    assert _reused(lambda a: a[:, [0, 2]])        # advanced indexing copies
    assert _reused(lambda a: None, m_next=3)      # fewer clients: a view of the same memory
    assert not _reused(lambda a: None, m_next=1)  # far fewer: fresh memory rather than holding 4x
    assert not _reused(lambda a: None, like_next=torch.zeros(5, dtype=torch.float64))


def test_a_wrong_out_matrix_is_refused_by_name():
    theta = torch.zeros(3)
    from fedlab_nb.core.round import LocalJob
    job = LocalJob(0, torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), [np.arange(2)], None)
    loss = lambda w, x, y: (w ** 2).sum()  # noqa: E731
    for kernel in (train_clients_loop, batched.train_clients_vmap):
        with pytest.raises(ValueError, match=r"out: expected a contiguous \[1, 3\]"):
            kernel(loss, theta, [job], 0.1, get_method("fedavg").objective, out=torch.zeros(2, 3))


def _history(digits_fed, method, backend, model="mlp"):
    h = simulate(method, digits_fed, model, rounds=3, clients_per_round=5, batch_size=16, lr=0.05, seed=1,
                 backend=backend, progress=False)
    return h.theta, h.select_dtypes("number").to_numpy()


@pytest.mark.parametrize("backend", ["loop", "vmap", "fused"])
@pytest.mark.parametrize("name", ["fedavg", "fedprox", "ditto", "fedrep", "scaffold"])
def test_reusing_the_rows_changes_no_result(digits_fed, monkeypatch, backend, name):
    """Every matrix handed out is NaN-filled first, so a backend that left an entry unwritten would show it;
    the run that reuses its rows equals, bit for bit, a run that takes fresh memory every round."""
    real, reused = RoundRows.take, []

    def take(self, key, m, like):
        before = self._kept[key].data_ptr() if key in self._kept else None
        out = real(self, key, m, like)
        reused.append(out.data_ptr() == before)
        return out.fill_(float("nan"))

    monkeypatch.setattr(RoundRows, "take", take)
    theta, numbers = _history(digits_fed, get_method(name), backend)
    assert any(reused), "no round reused its rows matrix"
    monkeypatch.setattr(rows, "unheld", lambda t: False)
    reused.clear()
    fresh_theta, fresh_numbers = _history(digits_fed, get_method(name), backend)
    assert not any(reused)
    assert torch.equal(theta, fresh_theta) and np.array_equal(numbers, fresh_numbers, equal_nan=True)


def test_a_rule_that_keeps_last_rounds_updates_keeps_them_intact(digits_fed):
    """A rule holding every round's update matrix: the rounds after it must not write into one it holds."""
    kept = []

    def keeping_mean(updates, weights=None):
        kept.append((updates, updates.clone()))
        return weighted_mean(updates, weights)

    method = dataclasses.replace(get_method("fedavg"), rule=keeping_mean)
    simulate(method, digits_fed, "mlp", rounds=4, clients_per_round=5, batch_size=16, seed=1, progress=False)
    assert len(kept) == 4
    assert all(torch.equal(held, copy) for held, copy in kept)
