"""`torchrec.modules`: embedding configs and collections."""
