"""TorchRec's own unit tests, run against lightning_rec (a package: its conftest must not shadow tests/conftest.py)."""
