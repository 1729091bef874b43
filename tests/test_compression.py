"""Compression transforms: exact encode/decode, byte counts equal to the payload and its layout, QSGD's
unbiasedness, top-k's selection, error feedback (exact bookkeeping, and resume in a new process), the
majority vote, PowerSGD's exact rank-r reconstruction, and clear errors on bad input."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch

import fedlab_nb as fl
from fedlab_nb.methods.communication import compression as C
from fedlab_nb.core.messages import Messages, TransformContext

PY = sys.executable


def _ctx(m, seed=0):
    return TransformContext(0, np.arange(m), torch.zeros(m, dtype=torch.bool), torch.Generator().manual_seed(seed),
                            torch.zeros(1))


@pytest.mark.parametrize("d", [37, 70_000])  # uint16 and uint32 indices
def test_topk_keeps_the_k_largest_exactly_and_counts_its_bytes(d):
    x = torch.randn(d, generator=torch.Generator().manual_seed(1))
    codec = C.TopK(25)
    blob = codec.encode(x)
    y = codec.decode(blob, d)
    kept = y != 0
    assert int(kept.sum()) == 25 and torch.equal(y[kept], x[kept])  # values exact (float32)
    assert x[kept].abs().min() >= x[~kept].abs().max()  # exactly the k largest |x|
    assert len(blob) == codec.payload_bytes(d) == 25 * (2 if d <= 2 ** 16 else 4) + 25 * 4


def test_randk_uses_the_generator_and_is_exact_on_its_entries():
    x = torch.randn(100)
    codec = C.RandK(0.1)
    a = codec.decode(codec.encode(x, torch.Generator().manual_seed(0)), 100)
    b = codec.decode(codec.encode(x, torch.Generator().manual_seed(1)), 100)
    assert int((a != 0).sum()) == 10 and torch.equal(a[a != 0], x[a != 0]) and not torch.equal(a, b)


def test_sign_codecs_are_exact_and_one_bit_per_entry():
    x = torch.tensor([0.5, -2.0, 0.0, 3.0, -1.0, 1.0, 2.0, -0.1, 4.0])
    plain, scaled = C.Sign(), C.Sign(scaled=True)
    assert torch.equal(plain.decode(plain.encode(x), 9), torch.tensor([1., -1, 1, 1, -1, 1, 1, -1, 1]))
    assert len(plain.encode(x)) == 2 and len(scaled.encode(x)) == 6 == scaled.payload_bytes(9)
    torch.testing.assert_close(scaled.decode(scaled.encode(x), 9), x.abs().mean() * plain.decode(plain.encode(x), 9))


def test_qsgd_layout_levels_and_unbiasedness():
    d, s = 50, 4
    x = torch.randn(d, generator=torch.Generator().manual_seed(3))
    codec = C.QSGD(s)
    g = torch.Generator().manual_seed(0)
    blob = codec.encode(x, g)
    assert len(blob) == codec.payload_bytes(d) == 4 + int(np.ceil(d * 3 / 8)) + int(np.ceil(d / 8))
    y = codec.decode(blob, d)
    levels = (y.abs() / x.norm() * s)
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)  # on the grid ‖x‖·l/s
    assert torch.all((torch.sign(y) == torch.sign(x)) | (y == 0))
    draws = torch.stack([codec.decode(codec.encode(x, g), d) for _ in range(4000)])
    se = draws.std(0) / np.sqrt(len(draws))
    z = ((draws.mean(0) - x).abs() / se.clamp_min(1e-12))[se > 0]
    assert z.max() < 4.5  # unbiased: every coordinate's mean within ~4.5 standard errors (d = 50)
    var = ((draws - x) ** 2).sum(1).mean() / x.norm() ** 2
    assert var <= min(d / s ** 2, np.sqrt(d) / s)  # Lemma 3.1's variance bound


def test_qsgd_buckets_roundtrip_the_norms():
    x = torch.randn(1000)
    codec = C.QSGD(1, bucket_size=128)
    blob = codec.encode(x, torch.Generator().manual_seed(0))
    assert len(blob) == 8 * 4 + 125 + 125 == codec.payload_bytes(1000)
    assert codec.decode(blob, 1000).shape == (1000,)


def test_powersgd_reconstructs_a_rank_r_matrix_exactly():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(30, 2, generator=g) @ torch.randn(2, 20, generator=g)
    bias = torch.randn(30, generator=g)
    x = torch.cat([M.reshape(-1), bias])
    codec = C.PowerSGD(2, shapes=((30, 20), (30,)))
    blob, q = codec.encode(x, torch.randn(codec.q_size(x.numel()), generator=g))
    assert len(blob) == codec.payload_bytes(x.numel()) == 4 * 2 * (30 + 20) + 4 * 30 and q.numel() == 40
    torch.testing.assert_close(codec.decode(blob, x.numel()), x, atol=1e-4, rtol=1e-4)


def test_error_feedback_residual_plus_sent_is_the_original():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    for t in (C.Compress(C.TopK(0.1)), C.Compress(C.Sign(scaled=True)), C.PowerSGDCompress(2)):
        state = {k: v.repeat(4, *[1] * v.dim()) for k, v in t.client_state(torch.zeros(300)).items()}
        state["residual"] = torch.randn(4, 300)
        p = x + state["residual"]
        msgs, new = t(Messages({"delta": x.clone()}, np.arange(4)), state, _ctx(4))
        if isinstance(t.codec, C.TopK):  # kept entries are p itself, the rest stays in e: exact
            assert torch.equal(new["residual"] + msgs["delta"], p) and torch.equal(new["residual"][msgs["delta"] != 0], torch.zeros(120))
        else:  # e = p − sent in float32: equal up to one rounding
            torch.testing.assert_close(new["residual"] + msgs["delta"], p, rtol=0, atol=1e-6)
        assert msgs.bytes.tolist() == [len(t.codec.encode(p[0], torch.Generator())) if not hasattr(t, "rank")
                                       else t.codec.payload_bytes(300)] * 4


def test_majority_vote_on_a_crafted_example():
    updates = torch.tensor([[0.1, -5.0, 0.2, -0.1], [0.3, 1.0, -0.2, -0.1], [-9.0, 2.0, 0.0, 0.4]])
    assert C.majority_vote(updates).tolist() == [1.0, 1.0, 0.0, -1.0]  # one vote each; 0 counts as no vote


def test_history_bytes_are_the_measured_payloads():
    fed = fl.federate("digits", "dirichlet", n_clients=6, alpha=0.5, seed=0, min_size=20)
    h = fl.simulate(C.qsgd_fedavg(4, None), fed, model="logreg", rounds=2, clients_per_round=3, lr=0.1, progress=False)
    assert (h["bytes_up"] == 3 * C.QSGD(4).payload_bytes(650)).all()


@pytest.mark.parametrize("bad, match", [(lambda: C.TopK(0), "k must be"), (lambda: C.TopK(-3), "k must be"),
                                        (lambda: C.QSGD(0), "s .quantisation levels. must be"),
                                        (lambda: C.PowerSGD(0), "rank must be"),
                                        (lambda: C.PowerSGD(5, ((4, 3),)).layout(12), "rank 5 is larger"),
                                        (lambda: C.PowerSGD(1, ((4, 3),)).layout(13), "shapes cover 12"),
                                        (lambda: C.Compress(None), "needs a codec")])
def test_bad_inputs_raise_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


RUN = textwrap.dedent("""
    import os, sys, torch, fedlab_nb as fl
    from fedlab_nb.methods.communication import compression as C
    fed = fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0, min_size=20)
    def die(r, theta, row):
        if r == int(os.environ.get("DIE_AT", "-1")):
            os._exit(9)
    h = fl.simulate(C.topk_fedavg(0.05), fed, model="logreg", rounds=5, clients_per_round=3, lr=0.1,
                    progress=False, checkpoint=sys.argv[1], resume=True, callback=die)
    h.save(sys.argv[2])
    torch.save(h.store.all("cpu")["uplink0.residual"], sys.argv[2] + ".res")
""")


def test_error_feedback_survives_resume_in_a_new_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([PY, script, tmp_path / "b.pt", tmp_path / "b.csv"], env={**env, "DIE_AT": "2"})
    assert killed.returncode == 9 and not (tmp_path / "b.csv").exists()
    resumed = subprocess.run([PY, script, tmp_path / "b.pt", tmp_path / "b.csv"], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    fed = fl.federate("digits", "dirichlet", n_clients=8, alpha=0.5, seed=0, min_size=20)  # uninterrupted, here
    full = fl.simulate(C.topk_fedavg(0.05), fed, model="logreg", rounds=5, clients_per_round=3, lr=0.1, progress=False)
    full.save(tmp_path / "a.csv")
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "a.csv"), pd.read_csv(tmp_path / "b.csv"))
    ra, rb = full.store.all("cpu")["uplink0.residual"], torch.load(str(tmp_path / "b.csv") + ".res")
    assert ra.abs().sum() > 0 and torch.equal(ra, rb)


# --- downlink ----------------------------------------------------------------------------------------------
def test_downlink_lossless_equals_plain_and_bytes_are_the_payload():
    import fedlab_nb as fl
    from fedlab_nb.methods.communication.compression import TopK, with_downlink
    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    plain = fl.simulate("fedavg", fed, "logreg", rounds=3, progress=False, backend="loop")
    full = fl.simulate(with_downlink(fl.get_method("fedavg"), TopK(1.0)), fed, "logreg", rounds=3, progress=False,
                       backend="loop")
    assert torch.equal(plain.theta, full.theta)  # k = d: every entry goes down, nothing changes
    d = plain.theta.numel()
    assert (full["bytes_down"] == 4 * TopK(1.0).payload_bytes(d)).all()


def test_downlink_copy_lags_by_exactly_what_was_not_sent():
    from fedlab_nb.methods.communication.compression import DownlinkCompress, TopK
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(50, generator=g)
    step = DownlinkCompress(TopK(5))
    state = step.init_state(theta0, 3)
    theta = theta0.clone()
    for _ in range(4):
        theta = theta + torch.randn(50, generator=g)
        p = theta - state["view"]
        view, state, nbytes = step(theta, state, g)
        sent = TopK(5).decode(TopK(5).encode(p), 50)
        assert torch.allclose(theta - view, p - sent, atol=1e-6) and nbytes == TopK(5).payload_bytes(50)
    with pytest.raises(ValueError, match="needs a codec"):
        DownlinkCompress(None)


def test_downlink_state_is_checkpointed_and_resumes(tmp_path):
    import fedlab_nb as fl
    from fedlab_nb.methods.communication.compression import TopK, with_downlink
    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    method = lambda: with_downlink(fl.get_method("fedavg"), TopK(0.2))
    whole = fl.simulate(method(), fed, "logreg", rounds=4, progress=False)
    ck = tmp_path / "run.pt"

    def stop_after_two(r, theta, row):
        if r == 2:
            raise KeyboardInterrupt  # killed after round 2's checkpoint
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(method(), fed, "logreg", rounds=4, progress=False, checkpoint=ck, callback=stop_after_two)
    resumed = fl.simulate(method(), fed, "logreg", rounds=4, progress=False, checkpoint=ck, resume=True)
    assert torch.equal(whole.theta, resumed.theta)  # the clients' copy θ̂ came back from the checkpoint
    assert whole["bytes_down"].tolist() == resumed["bytes_down"].tolist()
