"""FedSelect (fedlab_nb/methods/personalisation/fedselect.py): GradSelect on hand-made updates, the per-coordinate masked
average against a hand computation, masks that only grow, the shared-part wire format, bad knobs."""
import numpy as np
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core.method import RoundInfo
from fedlab_nb.core.messages import Messages
from fedlab_nb.methods.personalisation.fedselect import (SharedCoordinateMean, decode_shared, eligible_segments, encode_shared,
                                         fedselect, grow_mask, masked_mean)


def test_grow_mask_takes_top_p_of_still_global_by_abs_delta():
    mask = torch.tensor([True, False, False, False, False, True, False, False, False, False, False])
    delta = torch.tensor([9.0, 0.1, -5.0, 0.3, 2.0, 8.0, -0.2, 4.0, 0.0, -3.0, 1.0])
    # 9 of 11 still global: k = 9 - round(0.7 * 9) = 3 -> the largest |Δ| among them: 5, 4, 3 (positions 2, 7, 9)
    new = grow_mask(mask, delta, rate=0.3, limit=0.9, segments=[(0, 11)])
    expected = mask.clone()
    expected[[2, 7, 9]] = True
    assert torch.equal(new, expected)
    assert torch.equal(mask[[2, 7, 9]], torch.tensor([False] * 3))  # input untouched


def test_grow_mask_per_segment_limit_and_ties_by_position():
    mask = torch.zeros(8, dtype=torch.bool)
    mask[:3] = True                      # segment (0, 4): 3/4 personal > limit 0.5 -> skipped
    delta = torch.tensor([0.0, 0.0, 0.0, 7.0, 1.0, 1.0, 1.0, 0.5])
    new = grow_mask(mask, delta, rate=0.5, limit=0.5, segments=[(0, 4), (4, 8)])
    assert not new[3]                    # the big |Δ| of a full layer is not taken
    assert new[4:].tolist() == [True, True, False, False]   # k = 4 - 2 = 2, ties broken by position


def test_masked_mean_equals_hand_computation():
    deltas = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0], [5.0, 6.0, 7.0]])
    shared = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    weights = torch.tensor([1.0, 2.0, 3.0])
    # j=0: (1*1 + 2*3) / 3 = 7/3; j=1: (1*2 + 3*6) / 4 = 5; j=2: nobody shares -> 0
    out = masked_mean(deltas, shared, weights)
    assert torch.allclose(out, torch.tensor([7 / 3, 5.0, 0.0]))
    uniform = masked_mean(deltas, shared, torch.ones(3))
    assert torch.allclose(uniform, torch.tensor([2.0, 4.0, 0.0]))   # the official count average


def test_rule_reads_the_shared_mask_and_reports_fraction():
    deltas = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    shared = torch.tensor([[True, False], [True, True]])
    info = RoundInfo(0, np.arange(2), torch.ones(2), torch.ones(2), 2, 0.1,
                     messages=Messages({"delta": deltas, "shared": shared}, np.arange(2)))
    rule = SharedCoordinateMean()
    agg, state = rule.aggregate(rule.init_state(torch.zeros(2), 2), deltas, torch.ones(2), info=info)
    assert torch.allclose(agg, torch.tensor([2.0, 4.0]))
    assert rule.metrics(state) == {"shared_fraction": 0.75}


def test_wire_format_round_trips_and_counts_only_shared_values():
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(21, generator=g)
    shared = torch.rand(21, generator=g) > 0.4
    blob = encode_shared(delta * shared, shared)
    assert len(blob) == 3 + 4 * int(shared.sum())
    back, s = decode_shared(blob, 21)
    assert torch.equal(s, shared) and torch.equal(back, delta * shared)


def test_masks_only_grow_and_personal_coordinates_never_move_on_the_server():
    torch.set_num_threads(1)
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.3, seed=0)
    kw = dict(model="mlp", model_kwargs={"hidden": (16,)}, local_epochs=1, batch_size=32, lr=0.1, seed=0,
              progress=False, eval_every=10)
    masks, thetas = [], []
    for rounds in (3, 4, 5):  # the same run stopped after 3, 4 and 5 rounds (keyed randomness: identical prefixes)
        h = fl.simulate(fedselect(rate=0.3, limit=0.8, every=1), fed, rounds=rounds, **kw)
        masks.append(h.store.all("cpu")["mask"])
        thetas.append(h.theta)
    assert masks[0].any()
    for a, b in zip(masks, masks[1:]):
        assert torch.equal(a & b, a) and (b.sum() > a.sum())          # only grows, and does grow
    personal_for_all = masks[1].all(0)   # personal for every client in round 5 (trained with mask after round 4)
    assert torch.equal(thetas[2][personal_for_all], thetas[1][personal_for_all])
    spec = [(n, tuple(p.shape)) for n, p in h.model.named_parameters()]
    bias = torch.cat([torch.full((int(np.prod(s)),), n.endswith("bias")) for n, s in spec])
    assert not masks[2][:, bias].any()   # biases are never selected


def test_eligible_segments_and_bad_knobs():
    spec = [("body.0.weight", (3, 2)), ("body.0.bias", (3,)), ("body.2.weight", (1, 3))]
    assert eligible_segments(spec, ("*weight",)) == [(0, 6), (9, 12)]
    with pytest.raises(ValueError, match="match no parameter"):
        eligible_segments(spec, ("head.*",))
    with pytest.raises(ValueError, match="rate"):
        fedselect(rate=1.5)
    with pytest.raises(ValueError, match="limit"):
        fedselect(limit=-0.1)
    with pytest.raises(ValueError, match="every"):
        fedselect(every=0)
    with pytest.raises(ValueError, match="weighting"):
        fedselect(weighting="median")
    with pytest.raises(ValueError, match="evaluate"):
        fedselect(evaluate="after")


def test_personal_model_is_the_trained_weights_as_the_official_code_evaluates():
    """evaluate="trained" (official cross_client_eval before the broadcast): the client's last trained weights;
    "next_start": the new average on its shared coordinates, its own values on the personal ones."""
    torch.set_num_threads(1)
    fed = fl.federate("digits", "dirichlet", n_clients=4, alpha=0.3, seed=0)
    kw = dict(model="mlp", model_kwargs={"hidden": (16,)}, local_epochs=1, batch_size=32, lr=0.1, seed=0,
              progress=False, eval_every=10, rounds=3)
    method = fedselect(rate=0.3, limit=0.8, every=1)
    h = fl.simulate(method, fed, **kw)
    store = h.store.all("cpu")
    trained = method.client.personal(method, h.theta.cpu(), store, None)
    assert torch.equal(trained, store["own"])
    nxt = fedselect(rate=0.3, limit=0.8, every=1, evaluate="next_start")
    start = nxt.client.personal(nxt, h.theta.cpu(), store, None)
    assert torch.equal(start, torch.where(store["kept"], store["own"], h.theta.cpu()))
    assert not torch.equal(start, trained)   # the broadcast moved the shared coordinates
