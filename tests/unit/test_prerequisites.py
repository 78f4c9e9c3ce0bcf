"""tests/prerequisites.py: a missing prerequisite skips here and fails in CI."""

from __future__ import annotations

import pytest

from .. import prerequisites


class Item:
    """What check() reads of a pytest item: its markers."""

    def __init__(self, *marks: pytest.MarkDecorator):
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str):
        return (m for m in self.marks if m.name == name)


@pytest.mark.parametrize("ci", ["true", "1", "TRUE", "yes"])
def test_in_ci_a_missing_prerequisite_fails(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"needs a unicorn \(CI=true: a test that cannot run here fails"):
        prerequisites.missing("needs a unicorn")


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_elsewhere_it_skips(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="needs a unicorn"):
        prerequisites.missing("needs a unicorn")


def test_only_what_is_missing_stops_a_test(monkeypatch):
    monkeypatch.setenv("CI", "true")
    prerequisites.check(Item(prerequisites.requires(True, "present")))
    with pytest.raises(pytest.fail.Exception, match="absent"):
        prerequisites.check(Item(prerequisites.requires(True, "present"), prerequisites.requires(False, "absent")))
