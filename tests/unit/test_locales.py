"""Every catalog translates every message the UI uses, with the same placeholders, and compiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from babel.messages.extract import extract_from_dir
from babel.messages.frontend import parse_mapping_cfg
from babel.messages.pofile import read_po

from control_panel.i18n import LANGUAGES, LOCALES_DIR, Translator, compile_catalog, parse_accept_language, pick_language

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"%\((\w+)\)[sd]")


@pytest.fixture(scope="module")
def used() -> dict[str, list[str]]:
    """msgid -> where it is used, extracted with babel.cfg exactly as `pybabel extract` does."""
    with open(ROOT / "babel.cfg") as f:
        method_map, options_map = parse_mapping_cfg(f)
    found: dict[str, list[str]] = {}
    for filename, lineno, message, _comments, _context in extract_from_dir(ROOT, method_map, options_map):
        assert isinstance(message, str), f"plural forms are not used by the UI: {message!r} at {filename}:{lineno}"
        found.setdefault(message, []).append(f"{filename}:{lineno}")
    return found


def test_extraction_finds_the_ui(used):
    assert len(used) > 100
    for msg in (
        "Nodes",
        "Models",
        "Playground",
        "Requests",
        "Help",
        "Settings",
        "Log in",
        "Decode alone (run on the decoder)",
        "1. Start an agent on each machine",
    ):
        assert msg in used, msg


def _catalog(lang: str):
    with (LOCALES_DIR / lang / "LC_MESSAGES" / "messages.po").open("rb") as f:
        return read_po(f, locale=lang, abort_invalid=True)


@pytest.mark.parametrize("lang", sorted(LANGUAGES))
def test_catalog_is_complete(lang, used):
    catalog = _catalog(lang)
    missing = sorted(m for m in used if catalog.get(m) is None)
    assert not missing, f"{lang} misses {len(missing)} message(s): {missing[:10]}"
    problems = []
    for message in catalog:
        if not message.id:
            continue
        if not message.string or not str(message.string).strip():
            problems.append(f"empty msgstr: {message.id!r}")
        if message.fuzzy:
            problems.append(f"fuzzy: {message.id!r}")
        if sorted(PLACEHOLDER.findall(message.id)) != sorted(PLACEHOLDER.findall(message.string)):
            problems.append(f"placeholders differ: {message.id!r} -> {message.string!r}")
        if "%%" in message.string and not PLACEHOLDER.findall(message.id):  # never formatted: shown as is
            problems.append(f"a literal %% where nothing formats it: {message.id!r} -> {message.string!r}")
        for err in message.check(catalog):
            problems.append(f"{message.id!r}: {err}")
    assert not problems, f"{lang}: " + "; ".join(problems[:10])
    stale = sorted(m.id for m in catalog if m.id and m.id not in used)
    assert not stale, f"{lang} has messages the UI no longer uses: {stale[:10]}"


@pytest.mark.parametrize("lang", sorted(LANGUAGES))
def test_catalog_compiles_and_translates(lang, used):
    compiled = compile_catalog(LOCALES_DIR / lang / "LC_MESSAGES" / "messages.po")
    translated = {m: compiled.gettext(m) for m in used}
    assert all(translated.values())
    if lang != "en":
        same = [m for m, t in translated.items() if t == m]
        # a few words are the same in many languages (ok, TTFT, Engine...), most are not
        assert len(same) < len(used) * 0.15, f"{lang}: {len(same)} messages left in English: {same[:15]}"
    t = Translator(lang)
    assert "example.org" in t.gettext("Could not add %(url)s: %(reason)s", url="http://example.org", reason="x")


def test_language_choice():
    assert pick_language("ja", "de-DE,de;q=0.9") == "ja"
    assert pick_language(None, "de-DE,de;q=0.9,en;q=0.5") == "de"
    assert pick_language("nope", "fr-CA;q=0.4, it;q=0.8") == "it"
    assert pick_language(None, None) == "en"
    assert pick_language(None, "sv-SE") == "en"
    assert parse_accept_language("pt-BR") == "pt_BR"
    assert parse_accept_language("pt-PT,pt;q=0.9") == "pt_BR"
    assert parse_accept_language("zh-TW") == "zh_TW"
    assert parse_accept_language("zh-Hant-HK") == "zh_TW"
    assert parse_accept_language("zh-Hans-CN,zh;q=0.9") == "zh_CN"
    assert parse_accept_language("zh") == "zh_CN"
    assert parse_accept_language("ko-KR;q=0, ja;q=0.1") == "ja"
