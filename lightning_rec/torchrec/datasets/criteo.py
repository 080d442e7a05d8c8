"""`torchrec.datasets.criteo`: the Criteo column names (our loaders' keys: `C1`..`C26`, `I1`..`I13`, where TorchRec's
say `cat_0`.., `int_0`..) and the counts. The Criteo loaders are lightning_rec.data's (docs/torchrec.md)."""

from lightning_rec.data.criteo import (  # noqa: F401
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    INT_FEATURE_COUNT,
)

__all__ = ["CAT_FEATURE_COUNT", "DEFAULT_CAT_NAMES", "DEFAULT_INT_NAMES", "DEFAULT_LABEL_NAME", "INT_FEATURE_COUNT"]
