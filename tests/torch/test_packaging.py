"""`pip install crosstrain[torch]` over a torch the user already has keeps that torch.

Offline and in seconds: a fresh venv that sees this environment's packages (as
``--system-site-packages`` sees a system torch) asks pip, without any index, what installing
the torch extra's requirements would do. A pin the installed torch does not meet makes pip
want another torch (here: fail to find one), and the test fails.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.torch


def torch_extra() -> list[Requirement]:
    requirements = [Requirement(text) for text in importlib.metadata.requires("crosstrain") or []]
    chosen = [r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": "torch"})]
    assert chosen, "crosstrain declares no torch extra"
    return chosen


def test_the_installed_torch_satisfies_the_torch_extra() -> None:
    installed = importlib.metadata.version("torch")  # e.g. 2.13.0+cpu, or a user's CUDA build
    for requirement in torch_extra():
        if requirement.name == "torch":
            assert requirement.specifier.contains(installed, prereleases=True), (requirement, installed)


def test_pip_installing_the_torch_extra_over_an_existing_torch_installs_no_torch(tmp_path: Path) -> None:
    environment = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(environment)
    python = environment / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # this environment's packages (torch, pip) seen from the new one, as a system torch would be
    seen = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (Path(site) / "existing.pth").write_text("\n".join(sorted(seen)) + "\n")
    report = tmp_path / "report.json"
    result = subprocess.run(
        [python, "-m", "pip", "--isolated", "install", "--dry-run", "--no-index", "--quiet"]
        + ["--report", str(report)]
        # without the `extra == "torch"` marker, which pip would read as "not wanted here"
        + [f"{requirement.name}{requirement.specifier}" for requirement in torch_extra()],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": "/dev/null"},
    )
    assert result.returncode == 0, result.stderr
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == [], f"installing crosstrain[torch] would install {installs} over torch"


def test_the_check_sees_this_torch() -> None:
    """The pip test above is meaningful only while torch comes from this environment."""
    import torch

    assert Path(torch.__file__).is_relative_to(Path(sysconfig.get_path("purelib"))) or Path(
        torch.__file__
    ).is_relative_to(Path(sysconfig.get_path("platlib"))), sys.path
