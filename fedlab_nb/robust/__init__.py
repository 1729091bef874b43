"""Robust aggregation rules and Byzantine attacks, as pure functions on stacked ``[n, d]`` updates."""
from .attacks import (ATTACKS, alie, alie_z, choose_byzantine, flip_labels, gaussian_noise, get_attack, ipm,
                      no_attack, scaled, sign_flip)
from .rules import (RULES, bulyan, centered_clip, coordinate_median, drop_nonfinite, flag_aggregator, fltrust,
                    gas, geometric_median, get_rule, krum, mean, multi_krum, trimmed_mean)

__all__ = [
    "RULES", "get_rule", "drop_nonfinite", "mean", "coordinate_median", "trimmed_mean", "krum", "multi_krum",
    "bulyan", "geometric_median", "centered_clip", "flag_aggregator", "gas", "fltrust",
    "ATTACKS", "get_attack", "choose_byzantine", "flip_labels", "no_attack", "sign_flip", "scaled",
    "gaussian_noise", "alie", "alie_z", "ipm",
]
