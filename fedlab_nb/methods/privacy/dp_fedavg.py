"""DP-FedAvg — McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (arXiv:1710.06963), with Andrew, Thakkar, McMahan, Ramaswamy's adaptive clipping (NeurIPS 2021,
arXiv:1905.03871) as an option, and its local-DP counterpart for comparison.

DP-FedAvg is FedAvg's client update, then `ClipUpdates` (‖Δ_k‖ ≤ S) on the uplink, user weights w_k ≤ 1,
and the `DPAggregate` rule (estimator + Gaussian noise + accountant) before plain server SGD. The privacy
guarantee holds only with the sampling the accountant assumes, so build the run's sampler with the method:

    method, sampler = dp_fedavg_with_sampler(fed, noise_multiplier=1.0, clip_norm=0.5, sampling_rate=0.1)
    hist = fl.simulate(method, fed, clients_per_round=sampler, rounds=50)
    hist["epsilon"]                      # ε after each round at δ = hist["dp_delta"]

The rule raises if the round sizes it sees do not fit its q (e.g. clients_per_round=10 with Poisson q=0.1)."""
from __future__ import annotations

from ...core.registry import register
from .dp import (CappedWeighting, ClipUpdates, DPAggregate, LocalDPAccounting, LocalGaussianNoise,
                          dp_sampler)
from ...core.method import LocalObjective, Method, ServerSGD, UniformWeighting


@register("dp_fedavg", claims="dp_fedavg")
def dp_fedavg(noise_multiplier: float = 1.0, clip_norm: float = 1.0, sampling_rate: float = 0.1,
              delta: float = 1e-5, estimator: str = "fixed", adaptive: bool = False, target_quantile: float = 0.5,
              clip_lr: float = 0.2, clip_count_stddev: float | None = None, example_cap: float | None = None,
              total_weight: float | None = None, min_total_weight: float | None = None, sampling: str = "poisson",
              accountant: str = "rdp", local: bool = False, server_lr: float = 1.0) -> Method:
    """DP-FedAvg (central DP). `noise_multiplier` z, `clip_norm` S (the initial C when `adaptive`),
    `sampling_rate` q (the run must sample with `dp_sampler(q, K, sampling)`), `estimator` "fixed" (f̃_f)
    or "clipped" (f̃_c, with `min_total_weight` W_min, default W). `example_cap` ŵ gives w_k = min(n_k/ŵ, 1)
    and then needs `total_weight` W (`dp_fedavg_with_sampler` computes it); without it w_k = 1, W = K.
    `local=True` returns `local_dp_fedavg(noise_multiplier, clip_norm, delta, accountant, server_lr)`."""
    if local:
        return local_dp_fedavg(noise_multiplier, clip_norm, delta, accountant, server_lr)
    if example_cap is not None and total_weight is None:
        raise ValueError("example_cap (ŵ) makes w_k = min(n_k/ŵ, 1), so the rule needs total_weight = Σ_k w_k over "
                         "all users; use dp_fedavg_with_sampler(fed, ...) which computes it, or pass total_weight")
    rule = DPAggregate(noise_multiplier, clip_norm, sampling_rate, delta, estimator, total_weight, min_total_weight,
                       sampling, accountant, adaptive, target_quantile, clip_lr, clip_count_stddev)
    clip = ClipUpdates(None if adaptive else clip_norm)
    name = "dp_fedavg" + ("+adaptive" if adaptive else "")
    return Method(name, LocalObjective(), CappedWeighting(example_cap), rule, ServerSGD(lr=server_lr), uplink=(clip,))


@register("local_dp_fedavg", claims="dp_fedavg")
def local_dp_fedavg(noise_multiplier: float = 1.0, clip_norm: float = 1.0, delta: float = 1e-5,
                    accountant: str = "rdp", server_lr: float = 1.0) -> Method:
    """FedAvg with local DP: each client clips to S and adds N(0, (zS)² I) itself; the server averages.
    History's "epsilon" is the worst client's ε after its participations (no sampling amplification)."""
    return Method("local_dp_fedavg", LocalObjective(), UniformWeighting(), LocalDPAccounting(noise_multiplier, delta,
                  accountant), ServerSGD(lr=server_lr), uplink=(LocalGaussianNoise(clip_norm, noise_multiplier),))


def dp_fedavg_with_sampler(fed, **kwargs):
    """(DP-FedAvg method, the sampler its accountant assumes) for the federation `fed`: Poisson
    `BernoulliSampler(np.full(K, q))` or, with sampling="fixed", `UniformSampler(qK)`; with `example_cap`
    also W = Σ_k min(n_k/ŵ, 1) from the clients' training sizes. Pass the sampler as clients_per_round."""
    if kwargs.get("example_cap") is not None and kwargs.get("total_weight") is None:
        kwargs["total_weight"] = CappedWeighting(kwargs["example_cap"]).total(fed.sizes)
    method = dp_fedavg(**kwargs)
    if kwargs.get("local"):
        raise ValueError("local DP samples nothing in particular; use local_dp_fedavg(...) with any clients_per_round")
    return method, dp_sampler(method.rule.sampling_rate, fed.num_clients, method.rule.sampling)
