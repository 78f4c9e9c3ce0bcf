"""Tests whose prerequisite (root and iproute2 for network namespaces, a browser) this machine
lacks: skipped here, failed in CI (CI=true), where a skip would hide that the test never ran.

The one exception is CUDA: CI has no GPU, so the CUDA tests skip everywhere and are run by hand
on a lent GPU (README, "Tests").
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def missing(reason: str) -> NoReturn:
    """Inside a test or fixture whose prerequisite is missing: skip, or fail in CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a test that cannot run here fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def requires(available: bool, reason: str) -> pytest.MarkDecorator:
    """A marker: the test runs where `available`; elsewhere `missing(reason)`, before any fixture
    (checked by tests/conftest.py's pytest_runtest_setup)."""
    return pytest.mark.prerequisite(available, reason=reason)


def check(item: pytest.Item) -> None:
    for mark in item.iter_markers("prerequisite"):
        if not mark.args[0]:
            missing(mark.kwargs["reason"])
