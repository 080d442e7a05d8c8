"""The one helper TorchRec's sparse tests import from `torchrec.test_utils` (no sanitizer runs here)."""


def skip_if_asan_class(cls):
    return cls
