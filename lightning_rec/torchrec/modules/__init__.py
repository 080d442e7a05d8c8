"""`torchrec.modules`: embedding configs and collections, MLP, LowRankCrossNet."""
