"""Build the CUDA extension ``kvcompress._C`` from csrc/ where CUDA torch and nvcc exist.

Everywhere else (the CPU build) the package installs as pure Python and the ops fall
back to their Triton / PyTorch implementations. The extension needs the torch that vLLM
brings, so it is built WITHOUT build isolation (pip's isolated build has no torch):

    pip install vllm==0.32.0
    KVCOMPRESS_BUILD_CUDA=1 pip install -e . --no-build-isolation

``KVCOMPRESS_BUILD_CUDA=1``: the extension is required; the build fails naming what is
missing. ``KVCOMPRESS_NO_CUDA=1``: never build it. Neither: build it when possible, and
say why not otherwise. ``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0+PTX``: A100, H100, and
PTX that newer GPUs compile at load) picks the architectures.

pip shows none of this output unless the build fails (or ``-v``), so the decision is
also written to ``kvcompress/_build_record.py``: a CUDA engine without the extension
logs the recorded reason at start (``kvcompress.vllm_glue.engine_setup``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_RECORD = os.path.join(HERE, "kvcompress", "_build_record.py")
DEFAULT_ARCHS = "8.0;9.0+PTX"
ISOLATION_HINT = (
    "install vLLM (which brings CUDA torch) first, then build without isolation: "
    "KVCOMPRESS_BUILD_CUDA=1 pip install -e . --no-build-isolation"
)


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


@dataclass
class Toolchain:
    """What the build machine has (None: absent)."""

    torch_version: str | None  # None: torch not importable (e.g. pip's isolated build)
    torch_cuda: str | None  # torch.version.cuda; None for a CPU torch
    cuda_home: str | None
    nvcc_cuda: str | None  # "12.4" from `nvcc --version`; None: no nvcc on PATH


@dataclass
class BuildPlan:
    build: bool
    reason: str
    archs: str = DEFAULT_ARCHS
    warnings: list[str] = field(default_factory=list)


class ExtensionBuildError(RuntimeError):
    pass


def plan_build(env: dict[str, str], tools: Toolchain, have_sources: bool = True) -> BuildPlan:
    """Whether to build ``kvcompress._C``; raises :class:`ExtensionBuildError` naming the
    missing piece when ``KVCOMPRESS_BUILD_CUDA=1`` asked for it and it cannot be built."""
    required = env.get("KVCOMPRESS_BUILD_CUDA") == "1"
    if env.get("KVCOMPRESS_NO_CUDA") == "1":
        if required:
            raise ExtensionBuildError("KVCOMPRESS_BUILD_CUDA=1 and KVCOMPRESS_NO_CUDA=1 contradict each other")
        return BuildPlan(False, "KVCOMPRESS_NO_CUDA=1")
    archs = env.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    missing = None
    if not have_sources:
        missing = "csrc/ has no sources"
    elif tools.torch_version is None:
        missing = f"torch is not importable in the build environment; {ISOLATION_HINT}"
    elif tools.torch_cuda is None:
        missing = f"torch {tools.torch_version} is a CPU build (torch.version.cuda is None)"
    elif tools.nvcc_cuda is None or tools.cuda_home is None:
        missing = "nvcc was not found (install the CUDA toolkit, set CUDA_HOME, put nvcc on PATH)"
    elif tools.nvcc_cuda.split(".")[0] != tools.torch_cuda.split(".")[0]:
        missing = (
            f"nvcc is CUDA {tools.nvcc_cuda} but torch was built with CUDA {tools.torch_cuda}: "
            "the major versions must match"
        )
    if missing is not None:
        if required:
            raise ExtensionBuildError(f"kvcompress: KVCOMPRESS_BUILD_CUDA=1 but {missing}")
        return BuildPlan(False, missing, archs)
    plan = BuildPlan(True, f"CUDA {tools.nvcc_cuda}, torch {tools.torch_version}", archs)
    if tools.nvcc_cuda.split(".")[:2] != tools.torch_cuda.split(".")[:2]:
        plan.warnings.append(
            f"nvcc is CUDA {tools.nvcc_cuda}, torch was built with CUDA {tools.torch_cuda} "
            "(same major version: it should work)"
        )
    if "+PTX" not in archs:
        plan.warnings.append(
            f"TORCH_CUDA_ARCH_LIST={archs} has no +PTX: GPUs newer than its last architecture cannot load the extension"
        )
    return plan


def _nvcc_cuda_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", text)
    return found.group(1) if found else None


def probe_toolchain() -> Toolchain:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return Toolchain(None, None, os.environ.get("CUDA_HOME"), _nvcc_cuda_version())
    return Toolchain(torch.__version__, torch.version.cuda, CUDA_HOME, _nvcc_cuda_version())


def record_build(plan: BuildPlan, path: str = BUILD_RECORD) -> None:
    """Write whether ``kvcompress._C`` is built and why not, as a module of the package
    (a ``.py`` file ships in wheels and editable installs alike)."""
    reason = None if plan.build else plan.reason
    try:
        with open(path, "w", encoding="utf-8") as record:
            record.write(
                "# Written by setup.py at install (not tracked): whether the CUDA extension\n"
                "# kvcompress._C was built, and why not (read by a CUDA engine at start).\n"
                f"EXTENSION_BUILT = {plan.build!r}\n"
                f"REASON = {reason!r}\n"
            )
    except OSError as exc:  # a read-only tree: the engine then says it has no record
        print(f"kvcompress setup: warning: cannot write {path}: {exc}", file=sys.stderr)


def cuda_extensions():
    plan = plan_build(dict(os.environ), probe_toolchain(), have_sources=bool(csrc_sources()))
    record_build(plan)
    for warning in plan.warnings:
        print(f"kvcompress setup: warning: {warning}", file=sys.stderr)
    if not plan.build:
        print(f"kvcompress setup: not building the CUDA extension kvcompress._C: {plan.reason}", file=sys.stderr)
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ["TORCH_CUDA_ARCH_LIST"] = plan.archs
    print(f"kvcompress setup: building kvcompress._C ({plan.reason}; archs {plan.archs})", file=sys.stderr)
    extension = CUDAExtension(
        name="kvcompress._C",
        sources=csrc_sources(),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return [extension], {"build_ext": BuildExtension}


if __name__ == "__main__":
    ext_modules, cmdclass = cuda_extensions()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
