"""Probe 42n: a fourteenth, independent re-run of issue 42's failure classes, aimed first at what is new since the
thirteenth (utils.check_number and the DP entry points it now guards, History.privacy's last row, the OSError
wording on reads, publish's set-aside and put-back, the claims file's value limit, data fetch's archive, the loss
check's rows, backend='auto') and at variants the earlier test_probe42*.py do not try: the locational-DP
mechanisms' region ids, NaN values and draws, the randomised-response audits past ε ≈ 745, NormClipping's weak-DP
noise, a tilde in the results path, a History CSV whose rows are out of order, an interrupt right after publish
sets the old figures aside, hard links at the result file, escapes in a History sidecar, and deep or wide claims
files. Each test asserts the correct behaviour; a test marked xfail(strict=True) is an open finding (its reason
says what is wrong), so the suite stays green until it is fixed."""
import errno
import json
import os
import tarfile

import numpy as np
import pytest
import torch

import fedlab_nb as fl
from probes import KW as RUN
from probes import cli, fed10, one_line_error, root_copy, trace  # noqa: F401 (fed10: a fixture)
from probes import numbered_finding as F_

CONTROL = ("\x1b", "\x07", "\u202e", "\u2066", "\x9b", "\r", "\u2028", "\u200f", "\x85", "\u061c", "\ufeff")
RESULT = {"paper": "tiny", "scale": "smoke", "verdict": "reproduced", "metrics": {"value": 1.0},
          "claims": [{"id": "value_positive", "verdict": "reproduced", "expect": "> 0", "role": "headline"}]}


def _clean(text):
    return not any(c in text for c in CONTROL)


def _no_traceback(rc, err):
    assert rc in (0, 1) and "Traceback" not in err and "raised" not in str(rc), (rc, err)


def _refused_or_finite(call, match):
    """A DP helper given a bad number either refuses it (a ValueError naming the argument) or answers a finite
    number; a bare OverflowError / TypeError, a solver's message, or an inf / NaN answer is the finding."""
    try:
        out = call()
    except ValueError as e:
        assert any(word in str(e) for word in match.split("|")), str(e)
        return
    assert np.isfinite(np.asarray(out, dtype=float)).all(), out


# ================================================================================ (new code) check_number's inputs
@pytest.mark.parametrize("call", ["bag responses epsilon 10**400", "region means sigma 10**400",
                                  "check_number 10**400"])
@F_(1, "utils.check_number raises a bare OverflowError ('int too large to convert to float') for a Python int "
       "past float64 (10**400) instead of its ValueError naming the parameter")
def test_check_number_refuses_an_integer_past_float64_naming_it(call):
    from fedlab_nb.methods.beyond import locational_dp as L
    from fedlab_nb.methods.privacy import aggregate_responses as A
    from fedlab_nb.utils import check_number
    rng = np.random.default_rng(0)
    calls = {"bag responses epsilon 10**400": lambda: A.dp_bag_responses(rng.normal(size=20), A.random_bags(20, 4, rng),
                                                                         10 ** 400, 1.0, rng),
             "region means sigma 10**400": lambda: L.private_region_means([0, 1], [0.2, 0.5], 2, 1.0, 10 ** 400, rng),
             "check_number 10**400": lambda: check_number("epsilon", 10 ** 400, 0)}
    with pytest.raises(ValueError, match="epsilon|sigma"):
        calls[call]()


@pytest.mark.parametrize("value", [np.float16(0.5), np.int32(3), 2.0 ** -1022],
                         ids=["numpy float16", "numpy int32", "smallest normal"])
def test_check_number_takes_numpy_and_tiny_real_numbers(value):  # held
    from fedlab_nb.utils import check_number
    assert check_number("x", value, 0) == float(value)


@pytest.mark.parametrize("value", [complex(1, 0), np.array([1.0]), "1", b"1", [1.0], None, np.bool_(True)],
                         ids=["complex", "array", "text", "bytes", "list", "None", "numpy bool"])
def test_check_number_refuses_what_is_not_one_real_number(value):  # held
    from fedlab_nb.utils import check_number
    with pytest.raises(ValueError, match="x must be"):
        check_number("x", value, 0)


# ================================================================================ (1) DP: locational_dp variants
@pytest.mark.parametrize("case", ["epsilon 800", "sensitivity 1e-320", "sensitivity 1e308"])
@F_(2, "locational_dp.gaussian_sigma: epsilon 800 or a sensitivity near float64's limits ends in scipy's "
       "solver error ('The function value at x=1e-06 is NaN', 'xtol too small') naming no argument")
def test_locational_gaussian_sigma_at_extreme_arguments_names_them_or_answers(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    args = {"epsilon 800": (800.0, 1e-5, 1.0), "sensitivity 1e-320": (1.0, 1e-5, 1e-320),
            "sensitivity 1e308": (1.0, 1e-5, 1e308)}[case]
    _refused_or_finite(lambda: L.gaussian_sigma(*args), "epsilon|sensitivity")


@F_(3, "dp_robust.gaussian_sigma with delta=1e-300 gives scipy's bracket error ('`brentq` raised ValueError. "
       "This often means the supplied bracket interval...') instead of naming delta")
def test_dp_robust_gaussian_sigma_with_a_tiny_delta_names_it_or_answers():
    from fedlab_nb.methods.more import dp_robust as D
    _refused_or_finite(lambda: D.gaussian_sigma(1.0, 10, 1.0, 1e-300), "delta")


@pytest.mark.parametrize("case", ["dp_robust classic_sigma", "locational central_count_std"])
@F_(4, "a subnormal epsilon (1e-320) gives an infinite noise std (classic_sigma, central_count_std): the "
       "label-DP fix refuses it, these answer inf")
def test_a_subnormal_epsilon_gives_a_finite_sigma_or_is_refused(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    from fedlab_nb.methods.more import dp_robust as D
    call = {"dp_robust classic_sigma": lambda: D.classic_sigma(1.0, 10, 1e-320, 1e-5),
            "locational central_count_std": lambda: L.central_count_std(1e-320)}[case]
    _refused_or_finite(call, "epsilon")


@F_(5, "locational_dp.private_region_means releases NaN for the region of a user whose value is NaN (np.clip "
       "keeps NaN): the release shows which region holds it; label-DP refuses NaN responses")
def test_private_region_means_with_a_nan_value_is_refused():
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    try:
        out = L.private_region_means([0, 1, 1], [np.nan, 0.5, 0.2], 2, 1.0, 1.0, rng)
    except ValueError as e:
        assert "NaN" in str(e) or "nan" in str(e)
        return
    assert np.isfinite(out).all(), out


@pytest.mark.parametrize("case", ["means region -1", "means region 5 of 2", "means region 0.7",
                                  "shares region -1", "shares region 7 of 2"])
@F_(6, "locational_dp.private_region_means / private_region_shares take region ids unchecked: -1, an id >= "
       "n_regions or 0.7 give numpy's bare errors ('list' argument must have no negative elements, could not "
       "broadcast, Cannot cast)")
def test_region_ids_out_of_range_are_refused_naming_them(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    calls = {"means region -1": lambda: L.private_region_means([0, -1], [0.5, 0.5], 2, 1.0, 1.0, rng),
             "means region 5 of 2": lambda: L.private_region_means([0, 5], [0.5, 0.5], 2, 1.0, 1.0, rng),
             "means region 0.7": lambda: L.private_region_means([0.7, 1], [0.5, 0.5], 2, 1.0, 1.0, rng),
             "shares region -1": lambda: L.private_region_shares([0, -1], [0, 1], 2, 1.0, rng),
             "shares region 7 of 2": lambda: L.private_region_shares([0, 7], [0, 1], 2, 1.0, rng)}
    with pytest.raises(ValueError, match="region"):
        calls[case]()


@pytest.mark.parametrize("case", ["shares draws 2**40", "means draws -1", "means draws 1.5"])
@F_(7, "locational_dp's region releases take draws unchecked: 2**40 is a MemoryError (16 TiB), -1 numpy's "
       "'negative dimensions', 1.5 a bare TypeError (dp_bag_responses checks draws and MAX_RELEASED_VALUES)")
def test_region_releases_check_draws(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    calls = {"shares draws 2**40": lambda: L.private_region_shares([0, 1], [0, 1], 2, 1.0, rng, draws=2 ** 40),
             "means draws -1": lambda: L.private_region_means([0, 1], [0.2, 0.5], 2, 1.0, 1.0, rng, draws=-1),
             "means draws 1.5": lambda: L.private_region_means([0, 1], [0.2, 0.5], 2, 1.0, 1.0, rng, draws=1.5)}
    with pytest.raises(ValueError, match="draws"):
        calls[case]()


@pytest.mark.parametrize("epsilon,ok", [(True, False), (np.int64(3), True)], ids=["True refused", "numpy int taken"])
@F_(8, "locational_dp's epsilon check takes True as epsilon 1 and refuses np.int64(3) ('must be a finite "
       "number > 0, got np.int64(3)'): it is not check_number")
def test_randomized_response_epsilon_types_as_check_number(epsilon, ok):
    from fedlab_nb.methods.beyond import locational_dp as L
    rng = np.random.default_rng(0)
    if ok:
        assert L.randomized_response([0, 1], 2, epsilon, rng).shape == (2,)
    else:
        with pytest.raises(ValueError, match="epsilon"):
            L.randomized_response([0, 1], 2, epsilon, rng)


@pytest.mark.parametrize("case", ["unary_flip_log_ratio", "grr channel's max_log_ratio"])
@F_(9, "the randomised-response audits past epsilon ~745 answer NaN (unary_flip_log_ratio(800, 3)) or inf "
       "(max_log_ratio(grr_channel(800, 3)): q underflows to 0) for a mechanism whose loss is 800")
def test_randomized_response_audits_at_a_huge_epsilon_are_finite_or_refused(case):
    from fedlab_nb.methods.beyond import locational_dp as L
    call = {"unary_flip_log_ratio": lambda: L.unary_flip_log_ratio(800.0, 3),
            "grr channel's max_log_ratio": lambda: L.max_log_ratio(L.grr_channel(800.0, 3))}[case]
    with np.errstate(all="ignore"):
        _refused_or_finite(call, "epsilon")


@pytest.mark.parametrize("bits", [[2, 2, 2], [0.5, 0.5]], ids=["2", "0.5"])
@F_(10, "locational_dp.flip_bits takes non-bits: [2, 2, 2] comes back as 2 or -1 (1 - 2), 0.5 as 0.5: the "
        "output shows the input exactly")
def test_flip_bits_refuses_values_that_are_not_bits(bits):
    from fedlab_nb.methods.beyond import locational_dp as L
    with pytest.raises(ValueError, match="bit"):
        L.flip_bits(bits, 1.0, np.random.default_rng(0))


def test_grr_probabilities_past_700_stay_a_distribution():  # held
    from fedlab_nb.methods.beyond import locational_dp as L
    for eps in (699.9, 700.1, 5000.0):
        p, q = L.grr_probabilities(eps, 4)
        assert np.isfinite([p, q]).all() and abs(p + 3 * q - 1) < 1e-12 and p >= q


# ================================================================================ (1) DP: other noise parameters
@pytest.mark.parametrize("noise", [float("inf"), True, "0.1"], ids=["inf", "True", "text"])
@F_(11, "robustness.backdoors.NormClipping (weak DP) takes noise=inf or True, and noise='0.1' is a bare "
        "TypeError ('>=' not supported): check_number is not used there")
def test_norm_clipping_refuses_a_noise_that_is_not_a_finite_number(noise):
    from fedlab_nb.methods.robustness.backdoors import NormClipping
    with pytest.raises(ValueError, match="noise"):
        NormClipping(1.0, noise)


@pytest.mark.parametrize("q", ["0.05", True], ids=["text", "True"])
@F_(12, "FedSVD's lora_dp_method: sample_rate='0.05' is a bare TypeError, sample_rate=True is taken as q = 1")
def test_lora_dp_method_refuses_a_sample_rate_that_is_not_a_number(q):
    from fedlab_nb.lora import add_lora
    from fedlab_nb.methods.privacy.fedsvd import lora_dp_method
    model = add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)), 2)
    with pytest.raises(ValueError, match="sample_rate"):
        lora_dp_method(model, sample_rate=q, noise_multiplier=1.0, clip_norm=1.0)


def test_gradient_inversion_clip_and_noise_refuses_text_and_inf():  # held
    from fedlab_nb.methods.privacy.gradient_inversion import clip_and_noise
    for clip, z in ((1.0, "1"), (float("inf"), 1.0), (1.0, float("inf")), (True, 1.0)):
        with pytest.raises(ValueError):
            clip_and_noise({"w": torch.ones(3)}, clip, z, torch.Generator())


def test_dp_resume_mid_run_gives_the_epsilon_of_the_uninterrupted_run(fed10, tmp_path):  # held
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler

    def stop(r, theta, row):
        if r == 2:
            raise KeyboardInterrupt
    base = dict(noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1, accountant="pld")
    m0, s0 = dp_fedavg_with_sampler(fed10, **base)
    whole = fl.simulate(m0, fed10, rounds=5, clients_per_round=s0, seed=0, **RUN)
    m1, s1 = dp_fedavg_with_sampler(fed10, **base)
    with pytest.raises(KeyboardInterrupt):
        fl.simulate(m1, fed10, rounds=5, clients_per_round=s1, seed=0, checkpoint=tmp_path / "c.pt", callback=stop,
                    **RUN)
    m2, s2 = dp_fedavg_with_sampler(fed10, **base)
    resumed = fl.simulate(m2, fed10, rounds=5, clients_per_round=s2, seed=0, checkpoint=tmp_path / "c.pt",
                          resume=True, **RUN)
    assert np.allclose(resumed["epsilon"], whole["epsilon"]) and np.isfinite(resumed["epsilon"]).all()


def test_dp_on_a_conv_net_with_backend_auto_equals_the_loop(fed10):  # held (auto_backend: conv on CPU -> loop)
    from fedlab_nb.methods.privacy.dp_fedavg import dp_fedavg_with_sampler
    runs = []
    for backend in ("auto", "loop"):
        method, sampler = dp_fedavg_with_sampler(fed10, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.2)
        h, seen = trace(method, fed10, sampler, 2, model="cnn", backend=backend)
        runs.append((h, seen))
    (ha, sa), (hl, sl) = runs
    assert all(torch.equal(a, b) for a, b in zip(sa, sl)) and np.allclose(ha["epsilon"], hl["epsilon"])
