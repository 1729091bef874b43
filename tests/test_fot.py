"""FOT (Bakman et al., ICLR 2024): the server projection, the subspace extraction from summed client
sketches, and the continual task builders."""
import numpy as np
import pytest
import torch

from fedlab_nb.data.continual import class_groups, federate_tasks, permuted_tasks, split_tasks
from fedlab_nb.methods.personalisation.fot import (LayerBases, OrthogonalServerSGD, client_sketch, expand_bases, layer_inputs,
                                   linear_layers, run_continual)
from fedlab_nb.models import MLP, flatten_params, param_spec

torch.set_num_threads(1)


def _model(d=6, classes=3, hidden=(5,)):
    torch.manual_seed(0)
    return MLP(d, classes, hidden=hidden).double()


def _orthonormal(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64)).Q


def test_projection_removes_exactly_the_old_subspace_component():
    model = _model()
    spec = param_spec(model)
    U0, U1 = _orthonormal(6, 2, 1), _orthonormal(5, 3, 2)
    bases = LayerBases(spec, {"body.0.weight": U0, "body.2.weight": U1})
    g = torch.Generator().manual_seed(3)
    update = torch.randn(flatten_params(model).numel(), generator=g, dtype=torch.float64)
    out = bases.project(update)
    layers = linear_layers(spec)
    for name, U in bases.bases.items():
        o, r, c = layers[name]
        dW, pW = update[o:o + r * c].reshape(r, c), out[o:o + r * c].reshape(r, c)
        assert torch.allclose(pW, dW - dW @ U @ U.T, atol=1e-14, rtol=0)
        assert (pW @ U).abs().max() < 1e-14                       # nothing left in the old subspace
        P_perp = torch.eye(c, dtype=torch.float64) - U @ U.T
        assert ((dW - pW) @ P_perp).abs().max() < 1e-14                # only that component was removed
    mask = torch.ones_like(update, dtype=torch.bool)
    for name in bases.bases:
        o, r, c = layers[name]
        mask[o:o + r * c] = False
    assert torch.equal(out[mask], update[mask])                   # biases and the head: bit for bit
    assert bases.residual(out) < 1e-14 and bases.residual(update) > 0.1


def test_projected_step_keeps_old_inputs_outputs():
    model = _model()
    spec = param_spec(model)
    x_old = torch.randn(2, 6, dtype=torch.float64)
    U = torch.linalg.qr(x_old.T).Q                                # layer-0 inputs of the "old task"
    opt = OrthogonalServerSGD(lr=1.0, bases=LayerBases(spec, {"body.0.weight": U}))
    theta = flatten_params(model)
    delta = torch.randn_like(theta)
    new, state = opt.step(theta, delta, opt.init_state(theta, 1))
    o, r, c = linear_layers(spec)["body.0.weight"]
    W0, W1 = theta[o:o + r * c].reshape(r, c), new[o:o + r * c].reshape(r, c)
    assert torch.allclose(W1 @ x_old.T, W0 @ x_old.T, atol=1e-12)
    assert opt.metrics(state)["fot_residual"] < 1e-12


def test_bad_basis_is_refused_by_name():
    spec = param_spec(_model())
    with pytest.raises(ValueError, match="body.0.bias"):
        LayerBases(spec, {"body.0.bias": torch.eye(5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="in=6"):
        LayerBases(spec, {"body.0.weight": torch.eye(5, dtype=torch.float64)})


def test_summed_sketches_span_the_union_of_client_activation_spaces():
    spec = param_spec(_model(d=8))
    g = torch.Generator().manual_seed(0)
    e = torch.eye(8, dtype=torch.float64)
    # client 0's activations live in span(e0, e1), client 1's in span(e2), client 2's in span(e1 + e5)
    spans = [e[:, [0, 1]], e[:, [2]], (e[:, 1] + e[:, 5]).unsqueeze(1)]
    acts = [A @ torch.randn(A.shape[1], n, generator=g, dtype=torch.float64) for A, n in zip(spans, (7, 4, 5))]
    empty = LayerBases(spec)
    uploads = [client_sketch({"body.0.weight": R}, empty, torch.Generator().manual_seed(10 + k))
               for k, R in enumerate(acts)]
    new = expand_bases(empty, uploads, threshold=0.999999)
    U = new.bases["body.0.weight"]
    union = torch.linalg.qr(torch.cat(spans, 1)).Q
    assert U.shape == (8, 4)
    assert torch.allclose(U @ U.T, union @ union.T, atol=1e-10)    # the same subspace, exactly its dimension
    assert torch.allclose(U.T @ U, torch.eye(4, dtype=torch.float64), atol=1e-12)
    # a second round with the same activations finds nothing new: the residuals vanish
    again = [client_sketch({"body.0.weight": R}, new, torch.Generator().manual_seed(20 + k)) for k, R in enumerate(acts)]
    assert all(u["body.0.weight"][1] < 1e-10 for u in again)


def test_expansion_keeps_old_basis_and_stays_orthonormal():
    spec = param_spec(_model(d=8))
    e = torch.eye(8, dtype=torch.float64)
    old = LayerBases(spec, {"body.0.weight": e[:, [0]]})
    R = e[:, [0, 3]] @ torch.randn(2, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    up = client_sketch({"body.0.weight": R}, old, torch.Generator().manual_seed(2))
    U = expand_bases(old, [up], threshold=0.999999).bases["body.0.weight"]
    target = e[:, [0, 3]]
    assert U.shape == (8, 2) and torch.allclose(U @ U.T, target @ target.T, atol=1e-10)
    with pytest.raises(ValueError, match="threshold"):
        expand_bases(old, [up], threshold=1.5)


def test_layer_inputs_are_the_inputs_of_each_linear_layer():
    model = _model()
    x = torch.randn(4, 6, dtype=torch.float64)
    acts = layer_inputs(model, flatten_params(model), x)
    assert set(acts) == {"body.0.weight", "body.2.weight"}
    assert torch.equal(acts["body.0.weight"], x.T)
    assert torch.allclose(acts["body.2.weight"], torch.relu(model.body[0](x)).T.detach())


def test_split_tasks_split_the_classes():
    tasks = split_tasks("digits", classes_per_task=2)
    assert [t.meta["classes"] for t in tasks] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    full = __import__("fedlab_nb").load_dataset("digits")
    assert sum(len(t.y_train) for t in tasks) == len(full.y_train)
    for t in tasks:
        assert set(t.y_train.tolist()) == set(t.meta["classes"]) == set(t.y_test.tolist())
        assert t.num_classes == 10
    with pytest.raises(ValueError, match="divisor"):
        class_groups(10, 3)
    with pytest.raises(ValueError, match="order"):
        class_groups(4, 2, order=[0, 1, 1, 3])
    assert class_groups(4, 2, order=[3, 1, 0, 2]) == [[3, 1], [0, 2]]


def test_permuted_tasks_permute_features_and_keep_labels():
    tasks = permuted_tasks("digits", n_tasks=3, seed=0)
    base = tasks[0]
    for t in tasks[1:]:
        p = t.meta["permutation"]
        assert not np.array_equal(p, np.arange(64)) and sorted(p) == list(range(64))
        assert torch.equal(t.x_train, base.x_train[:, torch.as_tensor(p)])
        assert torch.equal(t.y_test, base.y_test)
    assert not np.array_equal(tasks[1].meta["permutation"], tasks[2].meta["permutation"])
    feds = federate_tasks(tasks, "dirichlet", n_clients=3, seed=0, alpha=0.5)
    assert [f.num_clients for f in feds] == [3, 3, 3]
    assert sum(len(y) for _, y in feds[1].client_train) + sum(len(y) for _, y in feds[1].client_test) == len(base.y_train)


def test_run_continual_fot_protects_the_first_task():
    tasks = federate_tasks(permuted_tasks("digits", n_tasks=2, seed=0), "iid", n_clients=2, seed=0)
    torch.manual_seed(0)
    model = MLP(64, 10, hidden=(32,))
    res = run_continual("fot", tasks, model, threshold=0.97, rounds=3, lr=0.1, eval_every=3)
    assert res.acc.shape == (2, 2) and len(res.basis_dims) == 1
    assert max(res.residual) < 1e-6
    assert 0 < res.basis_dims[0]["body.0.weight"] <= 64
