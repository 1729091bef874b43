"""Secure aggregation (Bonawitz et al., CCS 2017): exact sums under dropouts, the server holds no secret,
masked vectors look uniform, fixed point, and the round-pipeline plug-in equals FedAvg up to quantisation."""
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy import stats

import fedlab_nb as fl
from fedlab_nb.methods.privacy import secure_aggregation as S

BITS = 32


def _inputs(n, m, bits=BITS, seed=0):
    return np.random.default_rng(seed).integers(0, 2 ** bits, size=(n, m), dtype=np.uint64)


def _plain_sum(x, rows, bits=BITS):
    return x[list(rows)].sum(0) & np.uint64(2 ** bits - 1)


@pytest.mark.parametrize("dropouts", [None, [1, 4], {"masked_input": [0, 2], "unmasking": [5]},
                                      {"share_keys": [3], "masked_input": [6], "unmasking": [1]}])
def test_sum_is_exact_with_up_to_n_minus_t_dropouts(dropouts):
    n, t = 8, 5                        # at most n − t = 3 users may be lost in total
    x = _inputs(n, 37)
    res = S.run_protocol(x, t, bits=BITS, dropouts=dropouts)
    lost_before_y = set() if dropouts is None else set(
        dropouts if isinstance(dropouts, list) else [u for k in ("share_keys", "masked_input") for u in dropouts.get(k, [])])
    assert set(res.included) == set(range(n)) - lost_before_y  # dropping at unmasking keeps one's input in
    np.testing.assert_array_equal(res.sum, _plain_sum(x, res.included))


def test_sum_is_exact_mod_2_64_and_for_given_ids():
    x = _inputs(5, 11, bits=64)
    res = S.run_protocol(x, 3, bits=64, ids=[17, 3, 99, 4, 1000], dropouts=[99])
    assert res.included == (3, 4, 17, 1000)
    np.testing.assert_array_equal(res.sum, x[[0, 1, 3, 4]].sum(0))  # uint64 wraps mod 2^64


def test_too_many_dropouts_abort_naming_the_threshold():
    x = _inputs(8, 5)
    with pytest.raises(S.SecAggAbort, match=r"threshold t=6"):
        S.run_protocol(x, 6, dropouts=[0, 1, 2])                   # 5 survivors < t
    with pytest.raises(S.SecAggAbort, match=r"Unmasking.*threshold t=5"):
        S.run_protocol(x, 5, dropouts={"masked_input": [0, 1], "unmasking": [2, 3]})


def _walk(obj, seen=None):
    """Every leaf object reachable from obj through attributes, dict keys/values and sequences."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    children = []
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    for c in children:
        yield from _walk(c, seen)


def _secrets_of(clients):
    out = []
    for c in clients.values():
        out += [c.x.tobytes(), c.x.astype("<u4").tobytes()]             # the input, in memory and on the wire
        out += [c._c_sk.private_bytes_raw(), c._s_sk.private_bytes_raw()]
        if hasattr(c, "_b"):
            out += [c._b, c._own_b_share]
            out += [S.agree(c._s_sk, s_pk, b"secagg mask") for v, (_, s_pk) in c._keys.items() if v != c.uid]
        for v in getattr(c, "_inbox", {}):
            out += list(c._open(v))                                  # plaintext shares received
    return out


def test_server_holds_no_secret():
    x = _inputs(6, 20)
    res = S.run_protocol(x, 4, dropouts={"masked_input": [2], "unmasking": [5]})
    secrets = _secrets_of(res.clients)
    assert len(secrets) > 6 * 4
    blobs = [o.tobytes() if isinstance(o, np.ndarray) else bytes(o)
             for o in _walk(res.server) if isinstance(o, (bytes, bytearray, np.ndarray))]
    assert not any(isinstance(o, X25519PrivateKey) for o in _walk(res.server))
    assert not [s for s in secrets if any(s in b for b in blobs)]
    assert S.held_secrets(res.server, secrets) == []
    # the walk does find secrets where they are: in a client
    assert any(isinstance(o, X25519PrivateKey) for o in _walk(res.clients[0]))
    assert S.held_secrets(res.clients[0], secrets) != []


def test_masked_vector_looks_uniform_whatever_the_input():
    bits, m = 16, 20000
    zeros = np.zeros((3, m), dtype=np.uint64)
    ramp = np.tile(np.arange(m, dtype=np.uint64) % 7 * 1000, (3, 1))  # a very non-uniform input
    masked = [S.run_protocol(x, 2, bits=bits, seed=s).server.masked[0] for x, s in ((zeros, 1), (ramp, 2))]
    for y in masked:
        counts = np.bincount((y >> np.uint64(bits - 4)).astype(int), minlength=16)
        assert stats.chisquare(counts).pvalue > 1e-3                   # 16 equal bins of Z_(2^16)
    assert stats.ks_2samp(masked[0], masked[1]).pvalue > 1e-3          # same distribution for both inputs
    assert stats.ks_2samp(ramp[0], masked[1]).pvalue < 1e-6            # ... and not the input's


def test_bytes_are_the_encoded_messages():
    n, m = 6, 25
    res = S.run_protocol(_inputs(n, m), 4, dropouts=[5])
    u = 0
    assert res.sent[u]["advertise_keys"] == 64                          # two raw X25519 public keys
    assert res.sent[u]["share_keys"] == 32 + (n - 1) * (4 + 12 + 8 + 32 + 16 + 16)  # H(b_u); id, nonce, AES-GCM(ids‖shares)+tag
    assert res.sent[u]["masked_input"] == m * 4 + 32                    # uint32 per element at bits=32, then the MAC
    assert res.sent[u]["unmasking"] == 5 * (4 + 1 + 16) + (4 + 1 + 32)  # 5 b-shares (self included), 1 s^SK share
    assert res.received[u]["share_keys"] == n * (4 + 64)                # the roster


def test_seeded_runs_repeat_and_tampering_is_detected():
    x = _inputs(4, 9)
    a, b = (S.run_protocol(x, 3, seed=5).server.masked for _ in range(2))
    assert all((a[u] == b[u]).all() for u in a)
    assert (S.run_protocol(x, 3, seed=None).sum == _plain_sum(x, range(4))).all()
    params = S.SecAggParams(2, 3, 16)
    clients = [S.SecAggClient(u, np.zeros(3, np.uint64), params, np.random.default_rng(u)) for u in range(2)]
    server = S.SecAggServer(params)
    roster = server.collect_keys({c.uid: c.advertise_keys() for c in clients})
    inbox = server.collect_shares({c.uid: c.share_keys(roster) for c in clients})
    bad = bytearray(inbox[1]); bad[-1] ^= 1                              # flip one ciphertext bit
    clients[1].masked_input(bytes(bad))
    with pytest.raises(S.SecAggAbort, match="authentication"):
        clients[1].unmask(b"".join(int(u).to_bytes(4, "little") for u in (0, 1)))


def test_fixed_point_round_trip_and_overflow_condition():
    fp = S.FixedPoint(clip=2.0, scale=2.0 ** 10, bits=24)
    x = np.random.default_rng(0).uniform(-3, 3, 5000)
    back = fp.dequantize(fp.quantize(x))
    assert np.abs(back - np.clip(x, -2, 2)).max() <= fp.step / 2 + 1e-12
    rows = np.random.default_rng(1).uniform(-2, 2, (7, 100))            # 7·2048 < 2^23: decodes exactly
    fp.check_capacity(7)
    z = sum(fp.quantize(r) for r in rows) & S.modulus_mask(24)
    assert np.abs(fp.dequantize(z) - rows.sum(0)).max() <= 7 * fp.step / 2 + 1e-9
    with pytest.raises(ValueError, match="bits=24 is too small"):
        fp.check_capacity(2 ** 23 // fp.max_q)                           # W·max|q| reaches 2^23


@pytest.mark.parametrize("kwargs, match", [({"threshold": 9}, "2 <= t <= n"), ({"threshold": 1}, "2 <= t <= n"),
                                           ({"threshold": 3, "bits": 1}, "bits"),
                                           ({"threshold": 3, "dropouts": {"later": [1]}}, "stages")])
def test_bad_protocol_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.run_protocol(_inputs(8, 4, bits=16), **{"bits": 16, **kwargs})
    with pytest.raises(ValueError, match="integer array"):
        S.run_protocol(np.ones((3, 2)), 2)


def test_plug_in_needs_a_linear_rule_and_the_sizes():
    with pytest.raises(ValueError, match="robust rules"):
        S.with_secure_aggregation(fl.get_method("robust", rule="krum", f=1))
    with pytest.raises(ValueError, match="client_sizes"):
        S.with_secure_aggregation(fl.get_method("fedavg"))
    with pytest.raises(ValueError, match="bits"):
        S.secure_fedavg(bits=70)


@pytest.fixture(scope="module")
def tiny_fed():
    return fl.federate("digits", "dirichlet", n_clients=5, seed=0, alpha=0.5)


def test_secure_fedavg_equals_fedavg_up_to_quantisation(tiny_fed):
    torch.set_num_threads(1)
    kw = dict(model="logreg", rounds=1, clients_per_round=None, batch_size=32, lr=0.1, seed=0, progress=False)
    plain = fl.simulate(fl.get_method("fedavg"), tiny_fed, **kw)
    method = S.secure_fedavg(client_sizes=tiny_fed.sizes)
    secure = fl.simulate(method, tiny_fed, **kw)
    step = 1 / method.uplink[-1].scale
    diff = (plain.theta - secure.theta).abs().max().item()
    assert 0 < diff <= step / 2 + 1e-6                                  # one round from the same θ0
    assert secure["bytes_up"].iloc[0] == method.uplink[-1].last.bytes_sent().sum()
    # uniform weights: against FedAvg with UniformWeighting, and with a dropout the run still trains
    uniform = fl.simulate(fl.Method("u", weighting=S.UniformWeighting()), tiny_fed, **kw)
    sec_u = fl.simulate(S.secure_fedavg(), tiny_fed, **kw)
    assert (uniform.theta - sec_u.theta).abs().max().item() <= step / 2 + 1e-6
    dropped = S.secure_fedavg(client_sizes=tiny_fed.sizes, dropout=0.3, threshold=2)
    h = fl.simulate(dropped, tiny_fed, **{**kw, "rounds": 2})
    assert len(dropped.uplink[-1].last.included) <= 5 and np.isfinite(h.final("test_acc"))
    with pytest.raises(ValueError, match="bits=16 is too small"):        # Σ n_k · 2^16 ≥ 2^15
        fl.simulate(S.secure_fedavg(client_sizes=tiny_fed.sizes, bits=16), tiny_fed, **kw)


def _masked_round(seed, n=4, m=6, t=3):
    """One instance up to MaskedInputCollection: (clients, server, inbox, {u: masked input})."""
    params = S.SecAggParams(t, m, 32)
    rng = np.random.default_rng(seed)
    clients = {u: S.SecAggClient(u, rng.integers(0, 100, m), params, np.random.default_rng([seed, u])) for u in range(n)}
    server = S.SecAggServer(params)
    roster = server.collect_keys({u: c.advertise_keys() for u, c in clients.items()})
    inbox = server.collect_shares({u: c.share_keys(roster) for u, c in clients.items()})
    return clients, server, {u: c.masked_input(inbox[u]) for u, c in clients.items()}


@pytest.mark.parametrize("edit", ["replayed from an earlier instance", "sent under a dropped user's id",
                                  "two users' inputs swapped", "one bit of y flipped"])
def test_a_masked_input_not_bound_to_its_sender_and_instance_aborts_naming_it(edit):
    _, _, old = _masked_round(seed=1)
    clients, server, masked = _masked_round(seed=2)
    if edit == "replayed from an earlier instance":
        masked[1] = old[1]
    elif edit == "sent under a dropped user's id":
        masked = {u: (masked[3] if u == 1 else y) for u, y in masked.items() if u != 3}
    elif edit == "two users' inputs swapped":
        masked[1], masked[2] = masked[2], masked[1]
    else:
        masked[1] = bytes([masked[1][0] ^ 1]) + masked[1][1:]
    survivors = server.collect_masked(masked)
    with pytest.raises(S.SecAggAbort, match=r"client [12] \(its masked input\) does not carry its MAC"):
        server.unmask({u: clients[u].unmask(survivors) for u in masked})


def test_the_masked_input_mac_is_checked_and_holds_no_secret():
    clients, server, masked = _masked_round(seed=3)
    survivors = server.collect_masked(masked)
    total = server.unmask({u: c.unmask(survivors) for u, c in clients.items()})
    assert (total == sum(c.x for c in clients.values()) & np.uint64(2 ** 32 - 1)).all()
    assert all(len(y) == 6 * 4 + S.MAC_BYTES for y in masked.values())
    assert S.held_secrets(server, S.client_secrets(clients)) == []
