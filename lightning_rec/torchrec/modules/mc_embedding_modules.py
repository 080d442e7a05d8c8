"""`torchrec.modules.mc_embedding_modules`: embedding collections read through managed-collision modules."""

from lightning_rec.managed_collision import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection

__all__ = ["ManagedCollisionEmbeddingBagCollection", "ManagedCollisionEmbeddingCollection"]
