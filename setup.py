"""Build the CUDA extension ``kvcompress._C`` from csrc/ where CUDA torch and nvcc exist.

Everywhere else (the CPU build) the package installs as pure Python and the ops
fall back to their Triton / PyTorch implementations.
"""

import os
import shutil

from setuptools import setup


HERE = os.path.dirname(os.path.abspath(__file__))


def csrc_sources():
    """The torch binding (csrc/*.cpp, csrc/*.cu) plus the torch-free kernels (csrc/kernels/*.cu).

    Paths are relative to the project root, as setuptools wants them.
    """
    sources = []
    for folder in ("csrc", os.path.join("csrc", "kernels")):
        full = os.path.join(HERE, folder)
        if os.path.isdir(full):
            sources += sorted(
                os.path.join(folder, name)
                for name in os.listdir(full)
                if name.endswith((".cu", ".cpp"))
            )
    return sources


def cuda_extensions():
    if os.environ.get("KVCOMPRESS_NO_CUDA") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None or shutil.which("nvcc") is None:
        return [], {}
    sources = csrc_sources()
    if not sources:
        return [], {}
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    extension = CUDAExtension(
        name="kvcompress._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
