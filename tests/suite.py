"""`make test`'s pytest: the lanes, then the serial pass, then where the time went.

1. The lanes: `pytest -n 2 --dist loadscope -m "not quiet"`. tests/conftest.py's scheduler puts the
   integration tier and the system files with engine servers of their own in one unit (one worker, in order:
   the cluster, then those files); every other file is a unit of its own, run by whichever
   worker is free. Two lanes, not more: memory holds one set of engine servers, and the machine
   has two cores; each engine computes on one thread there (ONE_THREAD).
2. The serial pass: `pytest -m quiet`, the tests that time the machine itself, alone.
3. A summary from both passes' JUnit XML (reports/): seconds per file and per tier, the slowest
   files, when each lane ended (reports/lane-*.log, tests/conftest.py), and the wall clock since
   `make test` began (reports/started, written by the Makefile).

Both passes run whatever the first gave; the exit status is non-zero if either failed. Arguments
go to both pytest runs (e.g. `python -m tests.suite tests/system/test_cli.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from .seed import run_seed

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
LANES = "2"  # memory holds one set of engine servers; the machine has two cores
NO_TESTS = 5  # pytest's exit status when nothing was selected


# In the lanes every engine computes on one thread (agents and engine servers inherit this;
# settings that name a count win): two lanes on two cores each keep one busy instead of fighting
# over both. Six system files in two lanes: 245 s with the libraries' defaults, 215 s so.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pytest(*args: str, env: dict[str, str] | None = None) -> int:
    command = [sys.executable, "-m", "pytest", *args]
    print("+", " ".join(f"{k}={v}" for k, v in (env or {}).items()), *command[1:], flush=True)
    return subprocess.call(command, cwd=ROOT, env={**os.environ, **(env or {})})


def file_of(classname: str) -> str:
    """tests.integration.test_faults[.Class] -> tests/integration/test_faults.py"""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = Path(*parts[:n]).with_suffix(".py")
        if (ROOT / path).is_file():
            return path.as_posix()
    return classname


def per_file(reports: list[Path]) -> dict[str, list[float]]:
    """{file: [seconds, tests, failed]} over the JUnit reports (a test's time counts its set-up,
    so a file's first test carries the fixtures it starts)."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            row = files[file_of(case.get("classname", ""))]
            row[0] += float(case.get("time") or 0)
            row[1] += 1
            row[2] += any(child.tag in ("failure", "error") for child in case)
    return files


def summary(reports: list[Path], started: float) -> str:
    files = per_file([r for r in reports if r.is_file()])
    tiers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, (seconds, tests, _) in files.items():
        tier = "/".join(name.split("/")[:2])
        tiers[tier][0] += seconds
        tiers[tier][1] += tests
    lines = ["", "Seconds per file (set-up included; the lanes run side by side, so files overlap):"]
    for name, (seconds, tests, failed) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        mark = f"  {int(failed)} FAILED" if failed else ""
        lines.append(f"  {seconds:8.1f} s  {int(tests):4d} tests  {name}{mark}")
    lines.append(
        "Seconds per tier: " + ", ".join(f"{t} {s:.0f} s ({int(n)} tests)" for t, (s, n) in sorted(tiers.items()))
    )
    ends = []
    for log in sorted(REPORTS.glob("lane-*.log")):
        rows = [line.split(" ", 1) for line in log.read_text().splitlines()]
        cluster = " (the cluster's)" if any(nodeid.startswith("tests/integration/") for _, nodeid in rows) else ""
        ends.append(
            f"{log.stem.removeprefix('lane-')}{cluster} {float(rows[-1][0]) - started:.0f} s ({len(rows)} tests)"
        )
    if ends:
        lines.append("Lanes ended (since make test began): " + ", ".join(ends))
    wall = time.time() - started
    lines.append(f"make test: {wall / 60:.1f} minutes wall clock ({wall:.0f} s), set-up included")
    return "\n".join(lines)


def main(args: list[str]) -> int:
    # Bytecode is written (into __pycache__/, ignored by git) even where the machine says not to:
    # every agent, panel and pytest worker would compile the project and rewrite the pytest plugins'
    # assertions from source at each start (collecting tests/unit here: 25 s so, 9 s from the cache).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    REPORTS.mkdir(exist_ok=True)
    stamp = REPORTS / "started"
    started = float(stamp.read_text()) if stamp.is_file() else time.time()
    os.environ.setdefault("FUZZ_SEED", str(run_seed()))  # one seed for both passes
    lanes, quiet = REPORTS / "lanes.xml", REPORTS / "quiet.xml"
    for stale in (lanes, quiet, *REPORTS.glob("lane-*.log")):
        stale.unlink(missing_ok=True)
    first = pytest("-n", LANES, "--dist", "loadscope", "-m", "not quiet", f"--junitxml={lanes}", *args, env=ONE_THREAD)
    second = pytest("-n", "0", "-m", "quiet", f"--junitxml={quiet}", *args)
    print(summary([lanes, quiet], started), flush=True)
    return int(any(rc not in (0, NO_TESTS) for rc in (first, second)) or first == second == NO_TESTS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
