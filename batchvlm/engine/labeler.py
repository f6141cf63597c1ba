"""Where the engine's callers found WorkItem and sequence_seed before they moved beside the
family interface (models/ imports nothing from engine/)."""

from ..models.decoding import sequence_seed
from ..models.family import WorkItem

__all__ = ["WorkItem", "sequence_seed"]
