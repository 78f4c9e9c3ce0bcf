"""The panel's web UI: server-rendered pages (Jinja2), live parts with htmx, no build step.

One router per page or resource (`login`, `nodes`, `discovered`, `pools` (Models), `playground`,
`requests`, `settings`, `help`), included by `control_panel/app.py`; what a route needs comes
through `control_panel/deps.py`. This package imports none of its routers, so `deps.py` may
import its helpers (`sessions`, `render`).
"""
