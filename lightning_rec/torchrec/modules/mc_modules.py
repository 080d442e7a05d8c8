"""`torchrec.modules.mc_modules`: managed-collision modules and eviction policies."""

from lightning_rec.managed_collision import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)

__all__ = ["DistanceLFU_EvictionPolicy", "LFU_EvictionPolicy", "LRU_EvictionPolicy", "MCHEvictionPolicy",
           "MCHManagedCollisionModule", "ManagedCollisionCollection"]
