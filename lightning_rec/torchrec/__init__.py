"""TorchRec's module paths over lightning_rec: a port changes `torchrec.` to `lightning_rec.torchrec.` in its imports.

Each module here re-exports the real one (no second implementation); docs/torchrec.md lists the names we have, the
ones we do not, and why."""

from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
