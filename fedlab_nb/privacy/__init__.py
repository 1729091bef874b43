"""Privacy: defences usable with any method (DP clipping and noise with a real accountant, secure
aggregation) and attacks that observe what the server sees (gradient inversion).

Each module registers its own entries (`@register(..., kind="module")` or a method factory), so adding
one is adding a file; every module of this package is imported here, like `fedlab_nb.methods`."""
from __future__ import annotations

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
