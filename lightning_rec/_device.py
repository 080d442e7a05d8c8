"""What this environment offers for CUDA, and the one-line errors where it lacks what a call needs."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_missing() -> str | None:
    """What this environment lacks for CUDA training, and the fix (None when torch sees a CUDA device)."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU build: install the CUDA build of torch and the "
                f"fbgemm-gpu that matches it (README, 'GPU')")
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} finds no CUDA device: check that the GPU and its driver work "
                f"(`nvidia-smi`) and that CUDA_VISIBLE_DEVICES does not hide it")
    return None


def no_cuda_error(call: str, fix: str) -> ValueError | None:
    """The one-line error for `call` (a move to CUDA, pinning memory) without usable CUDA, naming the fix; else None."""
    what = cuda_missing()
    if what is None:
        return None
    return ValueError(f"CUDA is not available: {call} needs a CUDA GPU, but {what}; {fix}")


def check_device_ready(device: torch.device) -> None:
    """One line saying what is missing when tables are asked for on a GPU this environment cannot use."""
    if device.type != "cuda":
        return
    what = cuda_missing()
    if what is not None:
        raise ValueError(f"tables on device='cuda' (or accelerator='gpu') need a CUDA GPU, but {what}; or train "
                         f"with device='cpu' / accelerator='cpu'")
    import fbgemm_gpu  # noqa: F401

    if not torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::asynchronous_complete_cumsum", "CUDA"):
        raise ValueError("tables on device='cuda' need fbgemm-gpu built for CUDA, but this environment has the CPU "
                         "build (fbgemm-gpu-cpu): `pip uninstall fbgemm-gpu-cpu` and install the fbgemm-gpu that "
                         "matches your torch (README, 'GPU'), or train on CPU")


def with_cuda_index(device: torch.device, current_index: Callable[[], int], call: str | None = None,
                    fix: str = "or keep it on the CPU (device='cpu')") -> torch.device:
    """A CUDA device with its index ("cuda" alone: the current device's, as tensors report it); others unchanged.
    call: what asked for it (`DistributedModelParallel(device='cuda')`): without usable CUDA, one line saying so."""
    if device.type != "cuda":
        return device
    error = no_cuda_error(call, fix) if call is not None else None
    if error is not None:
        raise error
    return device if device.index is not None else torch.device("cuda", current_index())


def move_or_explain(call: str, device: torch.device | str | int | None, move):
    """move() (a copy to `device`, or pinning when device is None); without CUDA, one line that says so."""
    try:
        return move()
    except (RuntimeError, AssertionError):  # torch's words differ by build: check what is missing
        if device is None:
            error = no_cuda_error(call, "pinned memory only speeds up copies to a GPU: leave pin_memory=False here "
                                        "(the data modules' pin_memory, DataLoader(pin_memory=...))")
        elif torch.device(device).type == "cuda":
            error = no_cuda_error(call, "or keep it on the CPU (device='cpu', accelerator='cpu')")
        else:
            error = None
        if error is None:
            raise
        raise error from None
