"""The integration tier's one cluster (tests/integration/cluster.py), started once for the tier."""

from __future__ import annotations

import fcntl
from contextlib import ExitStack

import pytest

from engine_adapters.settings import EngineSettings
from engine_adapters.sglang_adapter import sglang_environment
from engine_adapters.vllm_adapter import vllm_python

from ..conftest import CLUSTER_LOCK, lane_first
from .cluster import Cluster

# a failed test's report carries this section; tests/conftest.py repeats it at the end of the run
SECTION = "the cluster when it failed"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and isinstance(cluster, Cluster):
        try:
            text = cluster.diagnosis()
        except Exception as e:  # the diagnosis must not hide the failure it describes
            text = f"no diagnosis: {type(e).__name__}: {e}"
        report.sections.append((SECTION, text))
    return report


@pytest.fixture(scope="package")
def cluster(smol_dir, tmp_path_factory):
    for name, check in (("vLLM", vllm_python), ("SGLang", sglang_environment)):
        try:
            check(EngineSettings())
        except Exception as e:
            pytest.fail(f"{name} is part of `make test`: {e}")
    with CLUSTER_LOCK.open("a") as lock, ExitStack() as stack:  # the cluster stops, then the lock goes
        fcntl.flock(lock, fcntl.LOCK_EX)  # the memory-heavy files wait while the cluster is up
        with lane_first():  # both cores for the start (tests/conftest.py FIRST_LOCK)
            cluster = Cluster(smol_dir, tmp_path_factory.mktemp("cluster"), stack)
        yield cluster
