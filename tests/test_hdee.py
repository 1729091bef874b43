"""HDEE (fedlab_nb/methods/beyond/hdee.py): the mixture bound, the posterior-mixture identity, the combination rules, the
toy chains and the batched experts. Exact checks in float64."""
import math

import numpy as np
import pytest
import torch

from fedlab_nb.methods.beyond import hdee


def _logp(E=3, n=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)  # genuine log-probabilities of observed tokens: log of values in (0, 1)
    return torch.log(torch.rand(E, n, T, generator=g, dtype=torch.float64) * 0.98 + 0.01)


# --- the exact mixture bound first ---------------------------------------------------------------
def test_mixture_bound_holds_and_is_tight_for_one_expert():
    lp = _logp().flatten(1)
    w = torch.softmax(torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 0)
    assert hdee.mixture_bound_violation(lp, w) <= 0
    per_token = torch.softmax(torch.randn(3, lp.shape[1], dtype=torch.float64), 0)
    assert hdee.mixture_bound_violation(lp, per_token) <= 0
    one = torch.ones(1, dtype=torch.float64)  # a single expert: the bound holds with equality
    assert hdee.mixture_bound_violation(lp[:1], one) == pytest.approx(0.0, abs=1e-15)


def test_mixture_bound_with_scipy_logsumexp():
    from scipy.special import logsumexp
    lp = _logp(E=4, seed=3).flatten(1).numpy()
    w = np.array([0.1, 0.2, 0.3, 0.4])
    mix = -logsumexp(np.log(w)[:, None] + lp, axis=0)
    expected = (mix[None] - (-lp - np.log(w)[:, None])).max()
    assert hdee.mixture_bound_violation(torch.as_tensor(lp), torch.as_tensor(w)) == pytest.approx(expected, abs=1e-12)
    assert expected <= 0


def test_posterior_mixture_telescopes_into_bayes_mixture():
    lp = _logp(E=3, n=5, T=11, seed=2)
    seq = hdee.ensemble_log_probs(lp, "uniform_prior").sum(-1)
    bayes = torch.logsumexp(lp.sum(-1), 0) - math.log(3)
    assert torch.allclose(seq, bayes, atol=1e-12, rtol=0)
    prior = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    seq = hdee.ensemble_log_probs(lp, "cached_prior", prior).sum(-1)
    assert torch.allclose(seq, torch.logsumexp(lp.sum(-1) + prior[:, None], 0), atol=1e-12, rtol=0)
    # hence within log E of the best expert on every sequence
    assert float((-hdee.ensemble_log_probs(lp, "uniform_prior").sum(-1) + lp.sum(-1).max(0).values).max()) \
        <= math.log(3) + 1e-12


def test_first_token_posterior_is_the_prior_and_simple_avg_is_a_geometric_mean():
    lp = _logp(seed=4)
    w = hdee.posterior(lp, torch.log(torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)))
    assert torch.allclose(w[:, :, 0], torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)[:, None].expand(3, 4))
    assert torch.allclose(w.sum(0), torch.ones(4, 7, dtype=torch.float64))
    geo = math.exp(np.mean([math.log(hdee.perplexity(lp[e])) for e in range(3)]))
    assert hdee.perplexity(hdee.ensemble_log_probs(lp, "simple_avg")) == pytest.approx(geo, rel=1e-12)


def test_cached_prior_matches_a_probability_space_loop():
    lp = _logp(E=3, n=6, T=5, seed=5)
    prior, decay = np.ones(3), 0.3  # the repo starts from unnormalised weights 1
    for n in range(6):
        post = prior * np.exp(lp[:, n].sum(-1).numpy())
        prior = decay ** (n + 1) * prior + post / post.sum()
    got = torch.exp(hdee.cached_log_prior(lp, decay=decay)).numpy()
    assert np.allclose(got, prior / prior.sum(), atol=1e-12)
    assert torch.allclose(hdee.cached_log_prior(lp, max_sequences=1), hdee.cached_log_prior(lp[:, :1]))


# --- toy chains ----------------------------------------------------------------------------------
TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer " * 3


@pytest.mark.parametrize("order", [1, 2, 3])
def test_cyclic_chain_is_stationary_and_entropy_rate_matches_scipy(order):
    from scipy.stats import entropy
    chain = hdee.fit_chain(TEXT, order)
    S = chain.n_symbols
    nxt = np.zeros_like(chain.stationary)  # π P over states: state (a, w) → (w, b) with P(b | a w)
    for s in np.flatnonzero(chain.stationary):
        for b in range(S):
            nxt[(s * S) % S ** order + b] += chain.stationary[s] * chain.probs[s, b]
    assert np.allclose(nxt, chain.stationary, atol=1e-14)
    H = sum(chain.stationary[s] * entropy(chain.probs[s]) for s in np.flatnonzero(chain.stationary))
    assert hdee.entropy_rate(chain) == pytest.approx(H, abs=1e-12)


def test_true_chain_perplexity_is_exp_entropy_rate():
    chain = hdee.fit_chain(TEXT, 1)
    seqs = hdee.sample_chain(chain, 64, 800, np.random.default_rng(0))
    ppl = math.exp(-hdee.chain_log_probs(chain, seqs).mean())
    assert ppl == pytest.approx(math.exp(hdee.entropy_rate(chain)), rel=0.02)


def test_windows_and_alphabet():
    assert hdee.ALPHABET[hdee._codes(hdee.to_alphabet("Ab, c!"))[2]] == " "
    x, y = hdee.windows(np.arange(10).reshape(2, 5), 3)
    assert x.tolist() == [[0, 1, 2], [1, 2, 3], [5, 6, 7], [6, 7, 8]] and y.tolist() == [3, 4, 8, 9]


# --- batched experts -----------------------------------------------------------------------------
def test_equal_compute_of_the_three_ensembles():
    params = {z: 3 * 8 * w + w + w * 27 + 27 for z, w in hdee.WIDTHS.items()}  # context 3, embed 8, vocab 27
    assert params["s"] + params["m"] + params["l"] == 3 * params["m"]
    for ens in hdee.ENSEMBLES:
        plan = hdee.expert_plan(ens)
        assert sum(params[z] * steps for z, steps in plan) == 3 * params["m"] * 400


def test_masked_units_do_not_change_outputs():
    g = [torch.Generator().manual_seed(0)]
    p = hdee.init_experts([5], g, max_width=9)
    x = torch.randint(27, (1, 6, 3))
    ref = hdee.expert_logits(p, x)
    noisy = dict(p, w1=p["w1"] + (1 - p["mask"])[:, None] * 3.0, w2=p["w2"] + (1 - p["mask"])[:, :, None] * 3.0)
    assert torch.allclose(hdee.expert_logits(noisy, x), ref)


def test_batched_training_equals_training_each_expert_alone():
    rng = np.random.default_rng(0)
    data = [hdee.windows(rng.integers(27, size=(8, 40)), 3) for _ in range(2)]
    gens = lambda: [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)]
    init = hdee.init_experts([4, 7], gens(), max_width=7)
    kw = dict(schedule_steps=20, warmup=2, lr=1e-2, min_lr=1e-3, batch_size=8)
    both = hdee.train_experts(init, data, [20, 12], gens(), **kw)
    for m in range(2):
        alone = hdee.train_experts(hdee.select(init, [m]), [data[m]], [[20, 12][m]], [gens()[m]], **kw)
        for k in alone:
            assert torch.allclose(both[k][m], alone[k][0], atol=1e-6)


def test_errors_name_the_parameter():
    lp = _logp()
    with pytest.raises(ValueError, match="rule must be one of"):
        hdee.ensemble_log_probs(lp, "average")
    with pytest.raises(ValueError, match="needs log_prior"):
        hdee.ensemble_log_probs(lp, "cached_prior")
    with pytest.raises(ValueError, match="order must be"):
        hdee.fit_chain(TEXT, 0)
    with pytest.raises(ValueError, match="decay must be"):
        hdee.cached_log_prior(lp, decay=1.0)
    with pytest.raises(ValueError, match="ensemble must be one of"):
        hdee.expert_plan("M_He-I_He")
    p = hdee.init_experts([4], [torch.Generator().manual_seed(0)])
    with pytest.raises(ValueError, match="steps must not exceed schedule_steps"):
        hdee.train_experts(p, [hdee.windows(np.zeros((2, 8), np.int64), 3)], [30], [torch.Generator()],
                           schedule_steps=20, warmup=1, lr=1e-2, min_lr=1e-3)
