"""Gradient inversion (fedlab_nb.methods.privacy.gradient_inversion): iDLG labels, DLG / IG recovery, metrics, defences."""
import numpy as np
import pytest
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from fedlab_nb.models import make_model
from fedlab_nb.methods.privacy import gradient_inversion as inv

SHAPE = (1, 8, 8)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def model_of(kind, seed=0, **kw):
    torch.manual_seed(seed)
    return make_model(kind, SHAPE, 10, **kw)


def test_idlg_label_exact_for_single_images_on_random_data():
    g = torch.Generator().manual_seed(0)
    for kind, kw in [("mlp", {"hidden": (16,)}), ("cnn", {"channels": (4, 8), "hidden": 16}), ("logreg", {})]:
        model = model_of(kind, **kw)
        for _ in range(20):
            x = torch.randn(1, 64, generator=g)
            y = torch.randint(0, 10, (1,), generator=g)
            assert inv.infer_labels(model, inv.client_gradient(model, x, y)).tolist() == y.tolist()


def test_sign_rule_never_returns_an_absent_class_when_labels_distinct():
    model = model_of("mlp", hidden=(32,))
    x = torch.rand(3, 64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([7, 2, 5])
    assert inv.infer_labels(model, inv.client_gradient(model, x, y), 3).tolist() == [2, 5, 7]


def test_dlg_recovers_one_digit_from_an_mlp_gradient(digits):
    x, y = digits[0][:1], digits[1][:1]
    model = model_of("mlp", hidden=(64,))
    rec = inv.dlg(model, inv.client_gradient(model, x, y), SHAPE, 1, iterations=20, seed=0)
    assert inv.psnr(rec.images[0], x.reshape(SHAPE)) > 30
    assert rec.labels.tolist() == y.tolist()          # DLG's soft label converges to the true class


def test_inverting_gradients_recovers_one_digit_to_stated_ssim(digits):
    x, y = digits[0][10:11], digits[1][10:11]
    model = model_of("mlp", hidden=(64,))
    rec = inv.inverting_gradients(model, inv.client_gradient(model, x, y), SHAPE, 1, iterations=200, seed=0)
    assert rec.labels.tolist() == y.tolist()          # iDLG labels
    assert inv.ssim(rec.images[0], x.reshape(SHAPE)) > 0.95
    assert float(rec.images.min()) >= 0 and float(rec.images.max()) <= 1   # the box projection


def test_reconstruct_from_update_matches_a_multi_step_update(digits):
    x, y = digits[0][20:21], digits[1][20:21]
    model = model_of("mlp", hidden=(32,))
    upd = inv.client_update(model, x, y, local_steps=2, local_lr=0.1)
    rec = inv.reconstruct_from_update(model, upd, SHAPE, 1, y, 2, 0.1, iterations=200, seed=0)
    assert inv.psnr(rec.images[0], x.reshape(SHAPE)) > 25


def test_client_update_one_step_is_minus_lr_times_gradient():
    model = model_of("mlp", hidden=(8,))
    x, y = torch.rand(4, 64), torch.tensor([0, 1, 2, 3])
    g, u = inv.client_gradient(model, x, y), inv.client_update(model, x, y, 1, 0.5)
    assert all(torch.allclose(u[k], -0.5 * g[k], atol=1e-7) for k in g)


def test_secure_sum_is_m_times_the_pooled_gradient():
    model = model_of("cnn", channels=(4, 8), hidden=16)
    x, y = torch.rand(3, 64), torch.tensor([1, 1, 4])
    total = inv.secure_sum([inv.client_gradient(model, x[i:i + 1], y[i:i + 1]) for i in range(3)])
    pooled = inv.client_gradient(model, x, y)
    assert all(torch.allclose(total[k], 3 * pooled[k], atol=1e-6) for k in pooled)


def test_clip_and_noise_clips_then_adds_noise_of_the_stated_scale():
    msg = {"a": torch.full((10_000,), 1.0)}                       # norm 100
    clipped = inv.clip_and_noise(msg, clip=2.0, noise_multiplier=0.0, generator=inv.generator(0, 1))
    assert float(clipped["a"].norm()) == pytest.approx(2.0, rel=1e-5)
    noisy = inv.clip_and_noise(msg, clip=2.0, noise_multiplier=0.5, generator=inv.generator(0, 1))
    assert float((noisy["a"] - clipped["a"]).std()) == pytest.approx(1.0, rel=0.05)


def test_metrics_match_skimage_on_known_pairs():
    r = np.random.default_rng(0)
    ref = r.random((8, 8))
    img = np.clip(ref + 0.05 * r.standard_normal((8, 8)), 0, 1)
    assert inv.psnr(img, ref) == pytest.approx(peak_signal_noise_ratio(ref, img, data_range=1.0))
    assert inv.ssim(img, ref) == pytest.approx(structural_similarity(ref, img, data_range=1.0))
    mse = np.mean((img - ref) ** 2)
    assert inv.psnr(img, ref) == pytest.approx(10 * np.log10(1 / mse))
    assert inv.ssim(ref, ref) == pytest.approx(1.0)


def test_hungarian_matching_is_permutation_invariant():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(5, 1, 8, 8, generator=g)
    rec = (ref + 0.05 * torch.randn(5, 1, 8, 8, generator=g)).clamp(0, 1)
    base = inv.recovery_scores(rec, ref)
    perm = torch.tensor([3, 0, 4, 1, 2])
    shuffled = inv.recovery_scores(rec[perm], ref)
    assert shuffled["psnr"] == pytest.approx(base["psnr"]) and shuffled["ssim"] == pytest.approx(base["ssim"])
    assert (perm[shuffled["perm"]] == torch.arange(5)).all()    # it undoes the shuffle


def test_total_variation_and_cosine_distance():
    x = torch.zeros(1, 1, 2, 2)
    x[0, 0, 0, 1] = 1.0
    assert float(inv.total_variation(x)) == pytest.approx(0.5 + 0.5)
    a = {"w": torch.tensor([1.0, 2.0])}
    assert float(inv.cosine_distance(a, {"w": torch.tensor([3.0, 6.0])})) == pytest.approx(0.0, abs=1e-7)
    assert float(inv.cosine_distance(a, {"w": torch.tensor([-2.0, 1.0])})) == pytest.approx(1.0)


def test_clear_errors_on_bad_input():
    model = model_of("mlp", hidden=(8,))
    x, y = torch.rand(2, 64), torch.tensor([0, 1])
    target = inv.client_gradient(model, x, y)
    with pytest.raises(ValueError, match="input_shape"):
        inv.inverting_gradients(model, target, (8, 8), 2, labels=y, iterations=1)
    with pytest.raises(ValueError, match="labels must be"):
        inv.inverting_gradients(model, target, SHAPE, 2, labels=torch.tensor([0]), iterations=1)
    with pytest.raises(ValueError, match="one gradient tensor per model parameter"):
        inv.dlg(model, {"body.0.weight": target["body.0.weight"]}, SHAPE, 2, iterations=1)
    with pytest.raises(ValueError, match="batch_size"):
        inv.infer_labels(model, target, 11)
    with pytest.raises(ValueError, match="at least as many recovered"):
        inv.match_images(torch.rand(1, 1, 8, 8), torch.rand(2, 1, 8, 8))
    with pytest.raises(ValueError, match="images"):
        inv.recovery_scores(torch.rand(8), torch.rand(8))
    with pytest.raises(ValueError, match="clip"):
        inv.clip_and_noise(target, clip=0, noise_multiplier=1, generator=inv.generator(0))
    with pytest.raises(ValueError, match="attack"):
        inv.gradient_inversion(model, x, y, SHAPE, attack="gan")


def test_module_entry_runs_and_is_registered(digits):
    from fedlab_nb.core.registry import lookup
    entry = lookup("gradient_inversion")
    assert entry.kind == "module" and entry.claims == "gradient_inversion"
    model = model_of("mlp", hidden=(32,))
    out = inv.gradient_inversion(model, digits[0][:2], digits[1][:2], SHAPE, attack="ig", labels="known",
                                 iterations=50)
    assert out["reconstruction"].images.shape == (2, *SHAPE) and np.isfinite(out["psnr"])
