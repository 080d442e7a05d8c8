"""`torchrec.models`: DLRM and its variants."""
