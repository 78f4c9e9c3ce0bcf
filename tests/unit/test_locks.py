"""The lock files agree with pyproject.toml's pins, and every package in them has a hash.

`make lock` writes them; a pin changed in pyproject.toml without it fails here, not on a user's
machine. Reads files only: no network.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

LINUX = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
MACOS = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"}
PRODUCT = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]
GROUPS = PYPROJECT["dependency-groups"]
# sglang and torchvision without their dependencies (tests/sglang_cpu/README.md)
SGLANG_NO_DEPS = [
    line
    for line in (ROOT / "tests/sglang_cpu/no-deps.in").read_text().splitlines()
    if line.strip()[:1] not in ("", "#")
]

# Each lock file: the requirements it was resolved from (Makefile, `lock`), and its platform.
LOCKS = {
    "locks/tandem-linux-x86_64-cpu.txt": (PRODUCT, LINUX),
    "locks/tandem-linux-x86_64-cuda.txt": (PRODUCT, LINUX),
    "locks/tandem-macos-arm64.txt": (PRODUCT, MACOS),
    "locks/vllm-linux-x86_64-cpu.txt": (GROUPS["vllm-cpu"], LINUX),
    "locks/vllm-linux-x86_64-cuda.txt": (GROUPS["vllm-cuda"], LINUX),
    "locks/sglang-linux-x86_64-cuda.txt": (GROUPS["sglang-cuda"], LINUX),
    "tests/sglang_cpu/lock-linux-x86_64-cpu.txt": (GROUPS["sglang-cpu"] + SGLANG_NO_DEPS, LINUX),
}


def read_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """{package: (version, its hashes)} of a pip requirements file as uv writes it."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pins: dict[str, tuple[Version, list[str]]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split(" --hash=")
        name, _, version = spec.strip().partition("==")
        assert version, f"{path.name}: {spec!r} is not pinned with =="
        key = canonicalize_name(name)
        assert key not in pins, f"{path.name}: {name} is listed twice"
        pins[key] = (Version(version.strip()), [o.strip() for o in options])
    return pins


def test_every_lock_file_is_checked_here():
    found = {str(p.relative_to(ROOT)) for p in [*ROOT.glob("locks/*.txt"), *ROOT.glob("tests/sglang_cpu/lock-*.txt")]}
    assert found == set(LOCKS) | {"locks/tools.txt"}


@pytest.mark.parametrize("lock", [*LOCKS, "locks/tools.txt"])
def test_every_package_has_a_sha256(lock):
    pins = read_lock(ROOT / lock)
    assert pins
    for name, (_, hashes) in pins.items():
        assert hashes, f"{lock}: {name} has no --hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), f"{lock}: {name}: {hashes}"


@pytest.mark.parametrize("lock", LOCKS)
def test_lock_pins_what_pyproject_pins(lock):
    """Every direct requirement that applies to the lock's platform is in it, at a version the
    requirement allows (pyproject's `==` pins: exactly that version; torch's CPU build, 2.13.0+cpu,
    is 2.13.0). So is the build backend the editable install builds with."""
    requirements, platform = LOCKS[lock]
    pins = read_lock(ROOT / lock)
    environment = {**platform, "python_version": "3.11", "python_full_version": "3.11.0"}
    for text in [*requirements, *PYPROJECT["build-system"]["requires"]]:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate(environment):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock} lacks {req.name} (pyproject.toml: {text}); run `make lock`"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{lock} has {req.name}=={version}, pyproject.toml says {text}; run `make lock`"
        )


def test_cpu_locks_take_pytorchs_cpu_build():
    """On Linux without NVIDIA the CUDA build of torch would bring gigabytes of nvidia-* packages."""
    for lock in ["locks/tandem-linux-x86_64-cpu.txt", "locks/vllm-linux-x86_64-cpu.txt"]:
        pins = read_lock(ROOT / lock)
        assert pins["torch"][0].local == "cpu", lock
        assert not [name for name in pins if name.startswith("nvidia-")], lock
