"""The panel's languages: Babel catalogs compiled in memory, picked per request.

Catalogs live in `locales/<lang>/LC_MESSAGES/messages.po`; at startup each one is compiled to a
`.mo` in memory (no generated file in the tree). A request's language is the `lang` cookie (set
by the switcher), else the best match of Accept-Language, else English.
"""

from __future__ import annotations

import gettext as _gettext
import io
from functools import cache
from pathlib import Path

from babel.messages.mofile import write_mo
from babel.messages.pofile import read_po

LOCALES_DIR = Path(__file__).resolve().parent / "locales"  # a symlink to the top-level locales/
DEFAULT = "en"
COOKIE = "lang"

# Code -> the language's own name (what the switcher shows; never translated).
LANGUAGES: dict[str, str] = {
    "en": "English",
    "de": "Deutsch",
    "es": "Español",
    "fr": "Français",
    "it": "Italiano",
    "ja": "日本語",
    "ko": "한국어",
    "pt_BR": "Português (Brasil)",
    "zh_CN": "简体中文",
    "zh_TW": "繁體中文",
}

# Accept-Language tags that name a language by another spelling.
_ALIASES = {
    "pt": "pt_BR",
    "zh": "zh_CN",
    "zh_hans": "zh_CN",
    "zh_sg": "zh_CN",
    "zh_hant": "zh_TW",
    "zh_hk": "zh_TW",
    "zh_mo": "zh_TW",
}


def compile_catalog(po_path: Path) -> _gettext.GNUTranslations:
    """Read a .po file and compile it to a gettext catalog in memory."""
    with po_path.open("rb") as f:
        catalog = read_po(f, locale=po_path.parent.parent.name, abort_invalid=True)
    buf = io.BytesIO()
    write_mo(buf, catalog, use_fuzzy=False)
    buf.seek(0)
    return _gettext.GNUTranslations(buf)


@cache
def translations(lang: str) -> _gettext.NullTranslations:
    path = LOCALES_DIR / lang / "LC_MESSAGES" / "messages.po"
    if lang not in LANGUAGES or not path.is_file():
        return _gettext.NullTranslations()
    return compile_catalog(path)


def load_all() -> None:
    """Compile every catalog now (at startup), so a broken one fails loudly and early."""
    for lang in LANGUAGES:
        translations(lang)


def _match(tag: str) -> str | None:
    tag = tag.strip().replace("-", "_").lower()
    if not tag or tag == "*":
        return None
    by_lower = {code.lower(): code for code in LANGUAGES}
    if tag in by_lower:
        return by_lower[tag]
    if tag in _ALIASES:
        return _ALIASES[tag]
    parts = tag.split("_")
    if parts[0] == "zh" and len(parts) > 1:  # zh-Hant-TW, zh-Hans-CN, ...
        return "zh_TW" if ("hant" in parts or "tw" in parts or "hk" in parts) else "zh_CN"
    return by_lower.get(parts[0]) or _ALIASES.get(parts[0])


def parse_accept_language(header: str | None) -> str | None:
    """The best language of ours in an Accept-Language header (q-values honoured), or None."""
    if not header:
        return None
    choices = []
    for i, item in enumerate(header.split(",")):
        tag, _, params = item.partition(";")
        q = 1.0
        for p in params.split(";"):
            name, _, value = p.strip().partition("=")
            if name == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        code = _match(tag)
        if code and q > 0:
            choices.append((-q, i, code))
    return min(choices)[2] if choices else None


def pick_language(cookie: str | None, accept_language: str | None) -> str:
    if cookie in LANGUAGES:
        return cookie
    return parse_accept_language(accept_language) or DEFAULT


class Translator:
    """gettext for one language, with new-style `%(name)s` formatting (as Jinja's i18n uses)."""

    def __init__(self, lang: str):
        self.lang = lang
        self._t = translations(lang)

    def gettext(self, message: str, **variables) -> str:
        text = self._t.gettext(message)
        return text % variables if variables else text

    def ngettext(self, singular: str, plural: str, n: int, **variables) -> str:
        variables.setdefault("num", n)
        return self._t.ngettext(singular, plural, n) % variables

    @property
    def html_lang(self) -> str:
        return self.lang.replace("_", "-")
