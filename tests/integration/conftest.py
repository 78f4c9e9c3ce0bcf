"""The integration tier's one cluster (tests/integration/cluster.py), started once for the tier."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from engine_adapters.settings import EngineSettings
from engine_adapters.sglang_adapter import sglang_environment
from engine_adapters.vllm_adapter import vllm_python

from .cluster import Cluster

# (test id, the cluster's diagnosis) of each failed test, repeated at the end of the run: CI shows
# only the head and the tail of pytest's output, and a failure's own report sits in between
DIAGNOSES: list[tuple[str, str]] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and isinstance(cluster, Cluster):
        try:
            text = cluster.diagnosis()
        except Exception as e:  # the diagnosis must not hide the failure it describes
            text = f"no diagnosis: {type(e).__name__}: {e}"
        report.sections.append(("the cluster when it failed", text))
        DIAGNOSES.append((item.nodeid, text))
    return report


@pytest.hookimpl(trylast=True)  # after --durations' table, so it sits just above the short summary
def pytest_terminal_summary(terminalreporter):
    for nodeid, text in DIAGNOSES:
        terminalreporter.write_sep("-", f"the cluster when {nodeid} failed")
        terminalreporter.write_line(text)


@pytest.fixture(scope="package")
def cluster(smol_dir, tmp_path_factory):
    for name, check in (("vLLM", vllm_python), ("SGLang", sglang_environment)):
        try:
            check(EngineSettings())
        except Exception as e:
            pytest.fail(f"{name} is part of `make test`: {e}")
    with ExitStack() as stack:
        yield Cluster(smol_dir, tmp_path_factory.mktemp("cluster"), stack)
