"""FedSVD / FFA-LoRA / DP-LoRA: the LoRA wrapper, the exact SVD refactorisation, the per-sample gradient bound,
per-sample clipping, the DP noise scale, and short runs on the round pipeline."""
import math

import numpy as np
import pytest
import torch

from fedlab_nb.data.federated import FederatedDataset
from fedlab_nb.lora import LoRALayout, add_lora, lora_layers
from fedlab_nb.methods.privacy.fedsvd import (LoRAServerRule, clip_per_sample, dp_sgd_clients, lora_dp_method,
                                      lora_gradient_norms, orthonormality_error, refactorize, run_dp_lora,
                                      run_fedsvd, run_ffa_lora)
from fedlab_nb.models import MLP, flatten_params


def _lora_mlp(rank=3, alpha=None, seed=0):
    torch.manual_seed(seed)
    return add_lora(MLP(12, 4, hidden=(10, 8)), rank, alpha, seed=seed)


def _random_theta(model, seed=1, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LoRALayout.of(model).size, generator=g) * scale


def _data(n=16, d=12, classes=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _orthonormal_theta(model, seed=1):
    """θ whose A's have orthonormal rows (a FedSVD refactorisation of random factors)."""
    lay = LoRALayout.of(model)
    factors = [(a_new, b_new) for b_new, a_new in (refactorize(b, a) for a, b in lay.split(_random_theta(model, seed)))]
    return lay.join(factors)


# --- refactorisation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("d,k,r", [(64, 100, 4), (128, 196, 8), (5, 5, 5)])
def test_refactorize_is_exact_and_orthonormal(d, k, r):
    g = torch.Generator().manual_seed(d + k + r)
    B, A = torch.randn(d, r, generator=g), torch.rand(r, k, generator=g) - 0.5
    B_new, A_new = refactorize(B, A)
    M = B @ A
    assert B_new.shape == B.shape and A_new.shape == A.shape and B_new.dtype == torch.float32
    assert (B_new @ A_new - M).norm() <= 1e-5 * M.norm()
    assert orthonormality_error(A_new) <= 1e-5
    # the new A spans the old A's row space (B A has full rank r here): same orthogonal projector
    assert torch.allclose(A_new.T @ A_new, torch.linalg.pinv(A) @ A, atol=1e-4)


def test_refactorize_rank_deficient_product_keeps_orthonormal_rows():
    B = torch.zeros(20, 4)
    B[:, 0] = 1.0  # B A has rank 1
    A = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    B_new, A_new = refactorize(B, A)
    assert (B_new @ A_new - B @ A).norm() <= 1e-5 * (B @ A).norm()
    assert orthonormality_error(A_new) <= 1e-5


def test_refactorize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="exceeds min"):
        refactorize(torch.randn(3, 4), torch.randn(4, 10))
    with pytest.raises(ValueError, match="same r"):
        refactorize(torch.randn(6, 3), torch.randn(4, 10))


def test_server_rule_leaves_the_global_function_unchanged():
    model = _lora_mlp()
    lay = LoRALayout.of(model)
    theta = _random_theta(model)  # A: not orthonormal (like the random init)
    rows = torch.stack([lay.b_only(_random_theta(model, seed=s)) for s in (3, 4, 5)])
    weights = torch.tensor([10.0, 20.0, 30.0])
    info = type("Info", (), {"theta": theta, "round": 0})()
    ffa = LoRAServerRule(lay, "ffa")(rows, weights, info=info)       # B̄ with the old A
    svd = LoRAServerRule(lay, "fedsvd")(rows, weights, info=info)    # the same product, refactorised
    x, _ = _data()
    f = lambda t: torch.func.functional_call(model, lay.params(t), (x,))
    assert torch.allclose(f(ffa), f(svd), atol=1e-5)
    for a, _ in lay.split(svd):
        assert orthonormality_error(a) <= 1e-5
    # refactor_every=2: round 0 is not a refactorisation round
    assert torch.equal(LoRAServerRule(lay, "fedsvd", refactor_every=2)(rows, weights, info=info), ffa)


# --- LoRA ---------------------------------------------------------------------------------------------
def test_lora_forward_equals_dense_merged_model():
    base = MLP(12, 4, hidden=(10, 8))
    model = add_lora(base, rank=3, alpha=6.0)
    theta = _random_theta(model)
    lay = LoRALayout.of(model)
    dense = MLP(12, 4, hidden=(10, 8))
    dense.load_state_dict(base.state_dict())
    with torch.no_grad():
        for name, s, (a, b) in zip(lay.names, lay.scalings, lay.split(theta)):
            dense.get_submodule(name).weight += s * b @ a
    x, _ = _data()
    out = torch.func.functional_call(model, lay.params(theta), (x,))
    assert torch.allclose(out, dense(x), atol=1e-5)
    assert lay.scalings == (2.0, 2.0)


def test_add_lora_starts_as_the_base_model_and_freezes_everything_else():
    base = MLP(12, 4, hidden=(10, 8))
    model = add_lora(base, rank=2)
    x, _ = _data()
    assert torch.allclose(model(x), base(x))  # B = 0
    names = [n for n, _ in model.named_parameters()]
    assert names == ["body.0.lora_A", "body.0.lora_B", "body.2.lora_A", "body.2.lora_B"]
    assert flatten_params(model).numel() == 2 * 12 + 10 * 2 + 2 * 10 + 8 * 2
    assert "body.4.weight" in dict(model.named_buffers())  # the head: frozen


def test_add_lora_errors_name_the_fix():
    base = MLP(12, 4, hidden=(10, 8))
    with pytest.raises(ValueError, match="rank must be an int in 1 … min"):
        add_lora(base, rank=9)
    with pytest.raises(ValueError, match="not nn.Linear modules"):
        add_lora(base, rank=2, targets=["body.1"])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        add_lora(base, rank=2, alpha=0)
    with pytest.raises(ValueError, match="no LoRA layers"):
        lora_layers(base)
    with pytest.raises(ValueError, match="variant"):
        lora_dp_method(add_lora(base, 2), "fedsvdd")
    with pytest.raises(ValueError, match="clip_norm"):
        lora_dp_method(add_lora(base, 2), noise_multiplier=1.0, clip_norm=None)


def test_lora_matches_peft():
    peft = pytest.importorskip("peft")
    base = MLP(12, 4, hidden=(10, 8))
    ours = add_lora(base, rank=3, alpha=6.0)
    theta = _random_theta(ours)
    lay = LoRALayout.of(ours)
    import copy
    ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=3, lora_alpha=6, target_modules=["body.0", "body.2"],
                                                                  lora_dropout=0.0))
    with torch.no_grad():
        for name, (a, b) in zip(lay.names, lay.split(theta)):
            layer = ref.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
    x, _ = _data()
    assert torch.allclose(torch.func.functional_call(ours, lay.params(theta), (x,)), ref(x), atol=1e-5)


# --- DP-SGD pieces ------------------------------------------------------------------------------------
def test_gradient_of_b_is_bounded_when_a_is_orthonormal():
    model = _lora_mlp(rank=3)
    theta = _orthonormal_theta(model)
    x, y = _data(n=32)
    b_norms, w_norms = lora_gradient_norms(model, theta, x, y)
    assert b_norms.shape == (32, 2) and (w_norms > 0).all()
    assert (b_norms <= w_norms * (1 + 1e-5) + 1e-8).all()  # every sample, every layer
    # and the bound is not vacuous: with a random A of large norm it fails for some sample
    lay = LoRALayout.of(model)
    big = lay.join([(10 * a, b) for a, b in lay.split(theta)])
    b_big, w_big = lora_gradient_norms(model, big, x, y)
    assert (b_big > w_big).any()


def test_per_sample_clipping_bounds_every_clipped_gradient():
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-2, 1, 50)  # per-sample norms from ≈0.04 to ≈40
    grads = {"a": torch.randn(50, 3, 4, generator=g) * scale.view(50, 1, 1),
             "b": torch.randn(50, 7, generator=g) * scale.view(50, 1)}
    clipped, norms = clip_per_sample(grads, 1.5)
    after = torch.sqrt(sum(t.reshape(50, -1).pow(2).sum(1) for t in clipped.values()))
    assert (after <= 1.5 * (1 + 1e-6)).all()
    small = norms < 1.5
    assert small.any() and torch.allclose(after[small], norms[small], rtol=1e-5)  # below C: unchanged
    with pytest.raises(ValueError, match="clip_norm"):
        clip_per_sample(grads, 0.0)


def test_dp_noise_has_the_calibrated_scale():
    model = _lora_mlp(rank=4)
    lay = LoRALayout.of(model)
    theta = _orthonormal_theta(model)
    x, y = _data(n=400)
    C, z, q, lr = 1e-3, 20.0, 0.1, 1.0  # tiny C: the clipped gradients (≤ 40·C) are swamped by the noise z·C
    W, _ = dp_sgd_clients(model, lay, theta, [(x, y)], train_a=False, steps=1, sample_rate=q, lr=lr, clip_norm=C,
                          noise_multiplier=z, generators=[torch.Generator().manual_seed(0)])
    step = (lay.b_only(W[0]) - lay.b_only(theta)) * q * len(y) / lr   # = Σ clipped + z C ξ
    assert step.std().item() == pytest.approx(z * C, rel=0.1)
    assert torch.equal(lay.split(W[0])[0][0], lay.split(theta)[0][0])   # A untouched (B-only)


# --- runs on the pipeline -----------------------------------------------------------------------------
def _fed(seed=0):
    g = torch.Generator().manual_seed(seed)
    clients = []
    for k in range(3):
        x = torch.randn(40, 12, generator=g)
        clients.append((x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()))
    return FederatedDataset.from_clients(clients)


def test_short_runs_orthonormal_a_bytes_and_determinism():
    fed, base = _fed(), MLP(12, 4, hidden=(10, 8))
    kw = dict(rank=2, rounds=2, local_steps=2, sample_rate=0.2, lr=0.5, seed=0)
    svd = run_fedsvd(fed, base, epsilon=8.0, **kw)
    again = run_fedsvd(fed, base, epsilon=8.0, **kw)
    assert torch.equal(svd.theta, again.theta)
    lay = LoRALayout.of(svd.model)
    for a, _ in lay.split(svd.theta):
        assert orthonormality_error(a) <= 1e-5
    ffa = run_ffa_lora(fed, base, epsilon=8.0, **kw)
    init = add_lora(base, 2, seed=0)
    assert torch.equal(lay.split(ffa.theta)[0][0], init.body[0].lora_A.detach())  # FFA: A frozen
    dp = run_dp_lora(fed, base, epsilon=None, **kw)
    b_floats, ab_floats = sum(d * r for d, _, r in lay.shapes), lay.size
    assert svd.bytes_up.iloc[0] == 3 * 4 * b_floats and dp.bytes_up.iloc[0] == 3 * 4 * ab_floats
    assert 0 < svd.meta["noise_multiplier"] and dp.meta["noise_multiplier"] == 0.0
    assert np.isfinite(svd.test_acc.iloc[-1]) and math.isfinite(dp.test_acc.iloc[-1])
    with pytest.raises(ValueError, match="epsilon"):
        run_fedsvd(fed, base, epsilon=0.0, **kw)
