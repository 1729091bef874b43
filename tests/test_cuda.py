"""The GPU path: rounds on an accelerator equal the CPU's (float32, up to summation order) on every backend,
and checkpoints taken there resume there. Skipped without a GPU (CI has none); `benchmarks/device/run.sh` runs
this file on the device machine. FEDLAB_TEST_DEVICE names another device (`cpu` checks the test's own code)."""
import os

import numpy as np
import pandas as pd
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.core import SGD, Adam, Method

DEVICE = os.environ.get("FEDLAB_TEST_DEVICE", "cuda")


def _available(device: str) -> bool:
    kind = torch.device(device).type
    return kind == "cpu" or (kind == "cuda" and torch.cuda.is_available())


pytestmark = pytest.mark.skipif(not _available(DEVICE), reason=f"needs a {DEVICE} device")

METHODS = {
    "fedavg": lambda: fl.get_method("fedavg"),
    "fedprox": lambda: fl.get_method("fedprox", mu=0.1),
    "scaffold": lambda: fl.get_method("scaffold"),
    "ditto": lambda: fl.get_method("ditto", lam=0.5),
    "adam-clients": lambda: Method("adam-clients", optimizer=Adam(lr=0.01)),
    "sgdm-clients": lambda: Method("sgdm-clients", optimizer=SGD(momentum=0.9, weight_decay=1e-3)),
}
KW = dict(rounds=3, clients_per_round=4, lr=0.05, progress=False, stragglers=0.5, seed=0)


@pytest.fixture(autouse=True)
def float32_products():
    """cuBLAS and cuDNN may compute float32 products in TF32 (a 10-bit mantissa); compare at float32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def digits():
    """A fresh federation each time: simulate(device=...) moves the one it is given."""
    return fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0, min_size=20)


def assert_close_on_both(method: str, **kw):
    """The run on the CPU and on DEVICE, each from a fresh federation, are the same to float32 precision."""
    fed = digits()
    cpu = fl.simulate(METHODS[method](), fed, device="cpu", **kw)
    dev = fl.simulate(METHODS[method](), digits(), device=DEVICE, **kw)
    n_test = len(fed.y_test)
    assert dev.meta["backend_used"] == cpu.meta["backend_used"]
    torch.testing.assert_close(dev.theta.cpu(), cpu.theta, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(dev["test_loss"].to_numpy(float), cpu["test_loss"].to_numpy(float), atol=1e-4)
    # one test image whose top two logits tie to float32 precision may flip: at most one per round
    np.testing.assert_allclose(dev["test_acc"].to_numpy(float), cpu["test_acc"].to_numpy(float), atol=1.01 / n_test)
    return dev


@pytest.mark.parametrize("backend", ["loop", "vmap", "auto"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_mlp_rounds_on_the_device_equal_the_cpu(method, backend):
    dev = assert_close_on_both(method, model="mlp", model_kwargs={"hidden": (16,)}, backend=backend, **KW)
    assert backend != "auto" or dev.meta["backend_used"] == "fused"   # the MLP qualifies for the fused step


@pytest.mark.parametrize("backend", ["loop", "vmap"])
def test_cnn_rounds_on_the_device_equal_the_cpu(backend):
    assert_close_on_both("fedavg", model="cnn", backend=backend, **KW)


def test_checkpoint_taken_on_the_device_resumes_there(tmp_path):
    kw = dict(KW, rounds=4, model="mlp", model_kwargs={"hidden": (16,)})
    full = fl.simulate("scaffold", digits(), device=DEVICE, **kw)
    ckpt = tmp_path / "run.pt"

    def crash(r, theta, row):
        if r == 2:
            raise KeyboardInterrupt   # killed after round 2 was checkpointed

    with pytest.raises(KeyboardInterrupt):
        fl.simulate("scaffold", digits(), device=DEVICE, checkpoint=ckpt, callback=crash, **kw)
    resumed = fl.simulate("scaffold", digits(), device=DEVICE, checkpoint=ckpt, resume=True, **kw)
    pd.testing.assert_frame_equal(pd.DataFrame(full), pd.DataFrame(resumed))
    assert torch.equal(full.theta, resumed.theta)
