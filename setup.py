"""Builds the optional C++ kernels in csrc/ as lightning_rec._C (torch cpp_extension).

Everything else is in pyproject.toml. CUDA sources are compiled only when a CUDA toolkit and a
CUDA build of torch are both present, so a CPU machine builds the CPU kernels alone. Build with
`pip install --no-build-isolation -e .` (the Makefile does): an isolated build environment would
download an unpinned torch.
"""

import glob
import os

from setuptools import setup


def _extensions():
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    if not cpu_sources:
        return [], {}
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    import torch

    cuda_sources = sorted(glob.glob("csrc/*.cu"))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and CUDA_HOME is not None
    cxx_flags = ["-O3", "-fopenmp", "-std=c++17"]
    if os.environ.get("LIGHTNING_REC_NATIVE_ARCH", "1") == "1":
        # Kernels are built on the machine that runs them (make test / make train), so tune for it.
        cxx_flags.append("-march=native")
    link_flags = ["-fopenmp"]
    if os.environ.get("LIGHTNING_REC_STATIC_LIBSTDCXX") == "1":
        # .ci/static-libstdcxx: a private copy of the C++ runtime in the extension, as some toolchains build it
        # (its iostreams can break every formatted error message: csrc/check_message.h)
        link_flags.append("-static-libstdc++")
    if os.environ.get("LIGHTNING_REC_SANITIZE") == "address":  # .ci/asan: the kernels under AddressSanitizer
        cxx_flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address", "-fopenmp", "-std=c++17"]
        link_flags.append("-fsanitize=address")
    kwargs = dict(
        name="lightning_rec._C",
        sources=cpu_sources + (cuda_sources if use_cuda else []),
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]} if use_cuda else {"cxx": cxx_flags},
        extra_link_args=link_flags,
        define_macros=[("WITH_CUDA", None)] if use_cuda else [],
    )
    ext = CUDAExtension(**kwargs) if use_cuda else CppExtension(**kwargs)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
