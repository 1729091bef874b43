"""PCB-Merging (fedlab_nb/methods/beyond/pcb_merging.py): the three identities, the official formula re-derived in numpy,
the per-task-head evaluator and the error messages."""
import numpy as np
import pytest
import torch

from fedlab_nb import merging
from fedlab_nb.methods.beyond import pcb_merging as PCB


def _taus(n=4, d=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) ** 3  # heavy tails, mixed signs


def _numpy_reference(taus, ratio, q=1e-4):
    # the steps of the repository's pcb-merging.py, written again with numpy order statistics
    t = taus.numpy()
    n, d = t.shape
    s = np.sort(np.abs(t), 1)
    mag = np.clip(np.abs(t), s[:, [int(d * q)]], s[:, [int(d * (1 - q)) - 1]])
    norm = (mag - mag.min(1, keepdims=True)) / (mag.max(1, keepdims=True) - mag.min(1, keepdims=True))
    score = np.exp(n * norm ** 2) * np.tanh(t * t.sum(0))
    lo = np.sort(score, 1)[:, [int(d * (1 - ratio))]]
    c = np.maximum(score, lo)
    w = (c - c.min(1, keepdims=True)) / (c.max(1, keepdims=True) - c.min(1, keepdims=True))
    return (w * np.sign(t) * mag).sum(0) / np.maximum(w.sum(0), 1e-12)


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.3, 1.0])
def test_matches_numpy_reference(ratio):
    taus = _taus()
    assert np.abs(PCB.pcb_merge(taus, ratio).numpy() - _numpy_reference(taus, ratio)).max() < 1e-12


def test_plain_average_is_task_arithmetic_over_k():
    taus, theta0 = _taus(5), torch.randn(3000, dtype=torch.float64)
    diff = merging.plain_average(theta0 + taus) - merging.task_arithmetic(theta0, taus, 1 / 5)
    assert diff.abs().max() < 1e-12


def test_equal_task_vectors_give_the_clipped_vector_on_kept_entries():
    same = _taus(1).expand(3, -1).clone()
    clipped, scores = PCB.pcb_scores(same)
    kept = PCB.pcb_weights(scores, 0.2)[0] > 0
    assert 0.15 < kept.double().mean() < 0.21  # the top-20 % share, less the threshold entry itself
    expected = torch.where(kept, clipped[0], torch.zeros_like(clipped[0]))
    assert (PCB.pcb_merge(same, 0.2) - expected).abs().max() < 1e-12
    assert (clipped[0].abs() <= same[0].abs()).all() and (clipped[0].abs() < same[0].abs()).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_sign_is_the_sign_of_the_total(seed):
    taus = _taus(5, seed=seed)
    _, scores = PCB.pcb_scores(taus)
    for ratio in (0.05, 0.1, 0.2):
        assert (scores.sort(1).values[:, int(scores.shape[1] * (1 - ratio))] >= 0).all()  # the derivation's condition
        merged = PCB.pcb_merge(taus, ratio)
        nonzero = merged != 0
        assert nonzero.any()
        assert (torch.sign(merged[nonzero]) == torch.sign(taus.sum(0)[nonzero])).all()


def test_sign_conflict_share():
    a = torch.tensor([[1.0, 2.0, -3.0, 0.1], [1.0, -2.0, -3.0, 0.1]])
    assert PCB.sign_conflict_share(a, top=0.5) == pytest.approx(1 / 2)  # coords 1 and 2 kept by both; 1 conflicts
    assert PCB.sign_conflict_share(a.abs(), top=0.5) == 0


def test_task_heads_route_rows_to_their_head():
    torch.manual_seed(0)
    full = PCB.mlp([6, 5, 4, 3])
    heads = [PCB.mlp([4, 3]) for _ in range(2)]
    ev = PCB.TaskHeads(full[:-1], torch.stack([h[0].weight for h in heads]), torch.stack([h[0].bias for h in heads]))
    x = torch.randn(7, 6)
    rows = torch.cat([PCB.TaskHeads.with_task(x[:3], 0), PCB.TaskHeads.with_task(x[3:], 1)])
    want = torch.cat([heads[0](full[:-1](x[:3])), heads[1](full[:-1](x[3:]))])
    assert torch.allclose(ev(rows), want, atol=1e-6)
    assert [n for n, _ in ev.named_parameters()] == ["trunk.0.weight", "trunk.0.bias", "trunk.2.weight", "trunk.2.bias"]
    assert next(ev.buffers(), None) is None


def test_pretrain_and_finetune_is_repeatable():
    torch.manual_seed(0)
    model = PCB.mlp([5, 4, 3])
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    kw = dict(pretrain_epochs=1, epochs=1, lr=0.1, seed=3)
    a0, a = PCB.pretrain_and_finetune(model, (x, y), [(x[:20], y[:20]), (x[20:], y[20:])], **kw)
    b0, b = PCB.pretrain_and_finetune(model, (x, y), [(x[:20], y[:20]), (x[20:], y[20:])], **kw)
    assert a.shape == (2, a0.numel()) and torch.equal(a0, b0) and torch.equal(a, b)
    assert not torch.equal(a[0], a[1])


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="ratio"):
        PCB.pcb_merge(_taus(), 0.0)
    with pytest.raises(ValueError, match="clip_quantile"):
        PCB.pcb_merge(_taus(), 0.1, clip_quantile=0.7)
    with pytest.raises(ValueError, match="top"):
        PCB.sign_conflict_share(_taus(), top=2)
    with pytest.raises(ValueError, match="tasks"):
        PCB.pretrain_and_finetune(PCB.mlp([2, 2]), (torch.zeros(2, 2), torch.zeros(2).long()), [], pretrain_epochs=1,
                                  epochs=1, lr=0.1)
