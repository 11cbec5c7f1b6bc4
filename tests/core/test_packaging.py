"""The package's extras respect a user's environment; CI's exact pins live only in constraints.txt.

Read from the files themselves (pyproject.toml, tox.ini, constraints.txt, the sources), so a
pin slipped back into an extra, a tox env that would download the GPU `tensorflow` wheel, or
a message naming an extra that does not exist fails here, in seconds, without a framework.
"""

from __future__ import annotations

import configparser
import re
import tomllib

from packaging.requirements import Requirement

from tests.conftest import REPO

FRAMEWORK_EXTRAS = {"torch": "torch", "tf": "tensorflow", "tf-cpu": "tensorflow-cpu"}
# extras a CI env may install: the small CPU wheels only, never `tf` or `all` (GPU tensorflow)
CI_EXTRAS = {"test", "lint", "torch", "tf-cpu", "plot", "tensorboard", "mlflow", "wandb", "sweep"}
# what CI installs that has a large or CUDA-carrying wheel: each pinned exactly
CI_PINNED = (
    "torch",
    "tensorflow-cpu",
    "tensorboard",
    "jax",
    "jaxlib",
    "matplotlib",
    "pyarrow",
    "tokenizers",
    "pillow",
    "mlflow-skinny",
    "wandb",
    "optuna",
)


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {
        name: [Requirement(text) for text in requirements]
        for name, requirements in project["optional-dependencies"].items()
    }


def constraints() -> dict[str, Requirement]:
    lines = (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {requirement.name: requirement for requirement in requirements}


def tox_extras() -> dict[str, set[str]]:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini", encoding="utf-8")
    base = tox["testenv"].get("extras", "")
    return {
        section: {name.strip() for name in tox[section].get("extras", base).split(",") if name.strip()}
        for section in tox.sections()
        if section.startswith("testenv")
    }


def test_framework_extras_are_ranges_that_keep_an_installed_framework() -> None:
    for extra, project in FRAMEWORK_EXTRAS.items():
        requirements = extras()[extra]
        assert [requirement.name for requirement in requirements].count(project) == 1
        for requirement in requirements:  # the framework, and what it needs beside it on a GPU
            operators = {spec.operator for spec in requirement.specifier}
            assert operators == {">="}, f"extra {extra!r} must be a lower bound, not {requirement}"


def test_all_brings_both_frameworks_the_plot_tensorboard_the_data_sources_and_the_trackers() -> None:
    (requirement,) = extras()["all"]
    assert requirement.name == "crosstrain"
    # GPU tensorflow for `pip install crosstrain[all]` on a GPU machine; tf-cpu is chosen by hand
    assert requirement.extras == {
        *("torch", "tf", "plot", "tensorboard", "images", "table", "text", "mlflow", "wandb", "sweep")
    }


def test_tox_envs_install_only_cpu_wheels_under_the_pins() -> None:
    for env, names in tox_extras().items():
        assert names <= CI_EXTRAS, f"[{env}] installs extras {sorted(names - CI_EXTRAS)}"
    pins = constraints()
    for name in CI_PINNED:
        assert {spec.operator for spec in pins[name].specifier} == {"=="}, f"{name} is not pinned"
    # an env that asked for the GPU tensorflow wheel fails to resolve rather than downloading it
    assert not pins["tensorflow"].specifier.contains("2.21.0")


def test_every_install_hint_names_an_extra_that_exists() -> None:
    named: set[str] = set()
    for path in (REPO / "src" / "crosstrain").rglob("*.py"):
        for group in re.findall(r"crosstrain\[([\w,-]+)\]", path.read_text(encoding="utf-8")):
            named.update(group.split(","))
    # the frameworks, the plot, tensorboard and the data sources' packages are each named
    # where they are missing
    named_here = {"torch", "tf", "tf-cpu", "plot", "tensorboard", "table", "text", "mlflow", "wandb", "sweep"}
    assert named_here <= named
    assert named <= set(extras()), f"messages name unknown extras: {sorted(named - set(extras()))}"
