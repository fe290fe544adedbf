"""jaxcoll.optax: gradient sync as optax transformations (optax itself is optional)."""

from jaxcoll._src.integrations.optax_sync import SyncState, sync

__all__ = ("SyncState", "sync")
