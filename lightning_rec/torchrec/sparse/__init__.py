"""`torchrec.sparse`: the jagged types."""
