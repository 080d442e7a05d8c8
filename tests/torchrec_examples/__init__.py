"""TorchRec's examples (BSD licence, headers kept) with only their import prefix changed: `torchrec.` ->
`lightning_rec.torchrec.`. tests/test_torchrec_examples.py runs them on 1 and 2 CPU ranks."""
