"""`History` lives in the contract layer (`fedlab_nb.core.history`); re-exported here."""
from ..core.history import METRICS, History

__all__ = ["METRICS", "History"]
