"""Managed-collision (ZCH) tables: raw int64 ids remapped to rows through an id map with batched eviction."""

from lightning_rec.managed_collision.collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    check_managed_collision,
    managed_collision_tables,
    reinit_rows,
)
from lightning_rec.managed_collision.mch import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)

__all__ = ["DistanceLFU_EvictionPolicy", "LFU_EvictionPolicy", "LRU_EvictionPolicy", "MCHEvictionPolicy",
           "MCHManagedCollisionModule", "ManagedCollisionCollection", "ManagedCollisionEmbeddingBagCollection",
           "ManagedCollisionEmbeddingCollection", "check_managed_collision", "managed_collision_tables",
           "reinit_rows"]
