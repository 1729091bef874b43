"""Registers the compressed methods of `fedlab_nb.compression` (top-k, rand-k, QSGD, signSGD, EF-signSGD,
PowerSGD), which live outside this package because they are transforms usable with any method."""
from .. import compression  # noqa: F401  (its @register decorators run on import)
