"""benchmarks/bench_conv.py (issue 43, item 3): its batched formulations of a conv net's local SGD step (im2col +
batched products, grouped convolutions in NCHW and channels-last, the vmap backend's step) give every client the
gradient pfl's one-client-at-a-time step gives, and the script runs."""
import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_conv.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_conv", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_batched_gradients_equal_pfl_step(bench):
    rows = bench.main(["--tiny"])
    variants = {r["variant"] for r in rows}
    assert {"a_pfl", "b_vmap", "c_unfold", "d_grouped", "d_grouped_cl", "e_limit", "e_limit_cl"} <= variants
    for r in rows:
        if r["variant"][0] in "bcd":
            assert r["max_abs_grad"] > 1e-3                                  # the check compared real gradients
            assert r["max_abs_dgrad"] <= 1e-5 * max(1.0, r["max_abs_grad"]), r
        assert r["step_s"] > 0 and r["gflops"] > 0


def test_unfold_forward_fails_on_swapped_client_weights(bench):
    """The check can fail: clients' logits under (c) and (d) are each client's own model; swapping two clients'
    weights changes them."""
    torch.manual_seed(0)
    factory, shape, C = bench.WORKLOADS["cnn_tiny"]
    model = factory(shape, 10)
    P = {n: (p.detach().expand(C, *p.shape) + 0.1 * torch.randn(C, *p.shape)).contiguous()
         for n, p in model.named_parameters()}
    x = torch.randn(C, 5, *shape)
    want = []
    for k in range(C):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(P[n][k])
            want.append(model(x[k].reshape(5, -1)))
    want = torch.stack(want)
    with torch.no_grad():
        for fwd in (bench.forward_unfold, bench.forward_grouped):
            assert torch.allclose(fwd(model, P, x), want, atol=1e-5)
        swapped = {n: p[[1, 0, *range(2, C)]] for n, p in P.items()}
        assert not torch.allclose(bench.forward_unfold(model, swapped, x), want, atol=1e-3)
        assert torch.allclose(bench.forward_grouped(model, P, x, channels_last=True), want, atol=1e-5)
