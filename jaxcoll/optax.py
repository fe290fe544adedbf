"""jaxcoll.optax: gradient sync as optax transformations (optax itself is optional)."""

from jaxcoll._src.training.optax_transform import SyncState, sync

__all__ = ("SyncState", "sync")
