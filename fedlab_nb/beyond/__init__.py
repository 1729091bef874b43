"""Aggregation beyond federated training: weight-space ensembles and merges, output ensembles and voting with
certificates, gradient aggregation for many objectives, and distributed estimation and private aggregation.

None of these methods is federated learning proper; each teaches an aggregation primitive FL relies on, and
its notebook ties it back to the FL chapters. They build on `fedlab_nb.merging` (task vectors, the shared
merge baselines, calibration metrics). Each module registers its own entries; every module of this package
is imported here, like `fedlab_nb.methods`."""
from __future__ import annotations

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
