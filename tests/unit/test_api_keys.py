"""API keys a program makes for itself: `tandem up` (make run) prints a new one at each start and
revokes the one it printed before, so keys do not pile up (UX walk finding 8)."""

from __future__ import annotations

from sqlmodel import Session, select

from control_panel.cli import issue_credentials
from control_panel.db import open_db
from control_panel.models import ApiKey
from control_panel.security import api_key_valid, create_api_key
from tandem_cli.up_cmd import UP_KEY_NAME


def test_each_start_of_tandem_up_revokes_the_key_the_last_one_printed(tmp_path):
    engine = open_db(tmp_path / "panel.db")
    try:
        mine = create_api_key(engine, "my app")  # a key the user made stays
        legacy = create_api_key(engine, "make-run-1a2b")  # one of the keys older versions left behind
        password, first = issue_credentials(tmp_path, UP_KEY_NAME, replaces="make-run-")
        again, second = issue_credentials(tmp_path, UP_KEY_NAME, replaces="make-run-")
        assert password and again is None  # the admin password is shown once, then kept hashed
        assert not api_key_valid(engine, first) and not api_key_valid(engine, legacy)
        assert api_key_valid(engine, second) and api_key_valid(engine, mine)
        with Session(engine) as s:
            assert sorted(k.name for k in s.exec(select(ApiKey))) == ["my app", UP_KEY_NAME]
    finally:
        engine.dispose()
