"""`torchrec.datasets`: Criteo's and MovieLens' constants, random batches, the Batch type."""
