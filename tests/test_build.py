"""setup.py's decision whether to build the CUDA extension (issue 15, item 8): it must
fail loudly when the extension was asked for and cannot be built, say why when it skips,
and ship PTX for GPUs newer than the listed architectures. No compiler is run."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def tools(setup_py, **overrides):
    values = dict(torch_version="2.9.0+cu128", torch_cuda="12.8", cuda_home="/usr/local/cuda", nvcc_cuda="12.8")
    values.update(overrides)
    return setup_py.Toolchain(**values)


def test_builds_with_ptx_where_everything_is_there(setup_py):
    plan = setup_py.plan_build({}, tools(setup_py))
    assert plan.build and plan.archs == "8.0;9.0+PTX" and not plan.warnings


@pytest.mark.parametrize("overrides,named", [
    (dict(torch_version=None, torch_cuda=None), "--no-build-isolation"),
    (dict(torch_cuda=None), "CPU build"),
    (dict(nvcc_cuda=None), "nvcc was not found"),
    (dict(cuda_home=None), "nvcc was not found"),
    (dict(nvcc_cuda="11.8"), "CUDA 11.8 but torch was built with CUDA 12.8"),
])  # fmt: skip
def test_required_extension_fails_loudly_naming_what_is_missing(setup_py, overrides, named):
    toolchain = tools(setup_py, **overrides)
    with pytest.raises(setup_py.ExtensionBuildError, match=named.replace("+", r"\+").replace(".", r"\.")):
        setup_py.plan_build({"KVCOMPRESS_BUILD_CUDA": "1"}, toolchain)
    # Not required: the pure-Python install goes on and says why.
    plan = setup_py.plan_build({}, toolchain)
    assert not plan.build and named in plan.reason


def test_minor_version_mismatch_and_missing_ptx_warn(setup_py):
    plan = setup_py.plan_build({"TORCH_CUDA_ARCH_LIST": "9.0"}, tools(setup_py, nvcc_cuda="12.4"))
    assert plan.build and plan.archs == "9.0"
    assert any("12.4" in warning for warning in plan.warnings)
    assert any("+PTX" in warning for warning in plan.warnings)


def test_opt_out_and_contradiction(setup_py):
    assert not setup_py.plan_build({"KVCOMPRESS_NO_CUDA": "1"}, tools(setup_py)).build
    with pytest.raises(setup_py.ExtensionBuildError, match="contradict"):
        setup_py.plan_build({"KVCOMPRESS_NO_CUDA": "1", "KVCOMPRESS_BUILD_CUDA": "1"}, tools(setup_py))
    plan = setup_py.plan_build({}, tools(setup_py), have_sources=False)
    assert not plan.build and "no sources" in plan.reason
