"""`tandem panel`: the control panel and its OpenAI-compatible API."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import secrets
import socket
from pathlib import Path

import typer
from rich.console import Console

console = Console()
# Connections at once: at the limit the one that has waited longest for a request is closed to
# make room (tandem_protocol/http_server.py); 503 only when every one is being answered.
MAX_CONNECTIONS = 1024


def issue_credentials(data_dir: Path, api_key_name: str, replaces: str | None = None) -> tuple[str | None, str]:
    """For a program that starts the panel (`tandem up`): the admin password if none was set yet
    (None otherwise: it is stored hashed) and a new API key, written to the panel's database in
    `data_dir` before the panel starts, and returned to the caller rather than printed. The keys
    named `api_key_name`, or starting with `replaces`, are revoked first: a program that makes one
    at each start would otherwise pile them up (a key is stored hashed: it cannot be shown again)."""
    from .db import open_db
    from .security import create_api_key, ensure_admin_password, revoke_api_keys_named

    engine = open_db(data_dir / "panel.db")
    try:
        revoke_api_keys_named(engine, api_key_name, prefix=replaces)
        return ensure_admin_password(engine), create_api_key(engine, api_key_name)
    finally:
        engine.dispose()


def is_loopback(host: str) -> bool:
    """Whether an address to listen on is reachable from this machine alone ("localhost" too; any
    other name counts as reachable from others)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def panel(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8080, help="Port to listen on (0 picks a free one)."),
    data_dir: Path = typer.Option(None, help="Where the panel keeps panel.db (default: $TANDEM_HOME/panel)."),
    node: list[str] = typer.Option(None, help="Agent URL to add and pair (repeatable)."),
    pair: list[str] = typer.Option(
        None,
        help="NAME=PREFILL_URL,DECODE_URL[,zstd|fp8|int8][,threshold=N]: serve a model by P/D (repeatable). Several "
        "nodes of a role join with '+' (NAME=P1,D1+D2: a pool); zstd: pages travel compressed, fp8: as FP8, int8: as INT8. Without a "
        "threshold the panel estimates each route's time to first token and picks the fastest; threshold=N "
        "overrides it: prompts with fewer new tokens than N (past what the decoder holds) run on the decoder "
        "alone, the rest P/D (threshold=1: always P/D).",
    ),
    api_key: str = typer.Option(None, help="Create an API key with this name and print it once."),
    reset_admin_password: bool = typer.Option(
        False,
        help="Set a new admin password, print it once and exit (works while the panel runs: signed-in "
        "sessions end, the next login takes the new password).",
    ),
    mdns: bool | None = typer.Option(
        None,
        "--mdns/--no-mdns",
        help="Add agents that announce themselves on the LAN (unpaired). Default: on unless --host is a "
        "loopback address (such a panel reaches no other machine's agent).",
        show_default=False,
    ),
    mdns_interface: list[str] = typer.Option(None, help="Interface address(es) for mDNS (default: all)."),
    stall_timeout: float = typer.Option(
        60.0, help="Seconds a client may take no data of its answer before the panel hangs up and frees the request."
    ),
    tls: bool = typer.Option(
        False,
        "--tls",
        help="Serve HTTPS with the panel's own self-signed certificate (made on first start; its SHA-256 "
        "fingerprint is printed, for clients to pin or trust once). For a panel other machines reach.",
    ),
    tls_cert: Path = typer.Option(None, help="Serve HTTPS with this certificate (PEM), e.g. one a CA signed."),
    tls_key: Path = typer.Option(None, help="The private key (PEM) of --tls-cert."),
    insecure_http: bool = typer.Option(
        False,
        "--insecure-http",
        help="Serve plain HTTP on an address other machines reach: anyone on the network can read the admin "
        "password, API keys, prompts and answers. Only for a link nobody else can reach.",
    ),
) -> None:
    """Serve the panel: add agents, pair them, and answer OpenAI API requests."""
    import uvicorn

    from tandem_protocol.http_server import PageStreamProtocol, quiet_shutdown_cancels, raise_open_file_limit
    from tandem_protocol.pages import ENCODINGS
    from tandem_protocol.settings import settings
    from tandem_protocol.tls import certificate_fingerprint, ensure_certificate, spaced

    from .app import create_panel_app
    from .db import open_db
    from .security import create_api_key, ensure_admin_password, set_admin_password
    from .services import MemberSpec, add_node, create_pool

    data_dir = data_dir or settings().data_dir / "panel"
    if reset_admin_password:  # the database alone, before any port: a running panel keeps serving
        password = secrets.token_urlsafe(12)
        set_admin_password(open_db(data_dir / "panel.db"), password)
        console.print(f"[bold]admin password[/] (shown once, stored hashed): {password}")
        console.print("Signed-in sessions have ended; a running panel takes the new password at its next login.")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_file_limit()  # MAX_CONNECTIONS sockets, beside the files and the engine's
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("give both --tls-cert and --tls-key, or neither")
    if insecure_http and (tls or tls_cert):
        raise typer.BadParameter("--insecure-http serves no certificate: drop --tls (or --tls-cert/--tls-key), or it")
    plain_on_lan = not is_loopback(host) and not (tls or tls_cert)
    if plain_on_lan and not insecure_http:
        raise typer.BadParameter(
            f"--host {host} is reachable from other machines: serve HTTPS (--tls, or --tls-cert/--tls-key), "
            "or give --insecure-http to serve plain HTTP, which anyone on the network can read (the admin "
            "password, API keys, prompts and answers)"
        )
    if mdns is None:
        mdns = not is_loopback(host)
    if tls and tls_cert is None:
        tls_cert, tls_key = ensure_certificate(data_dir / "tls", "panel")
    scheme = "https" if tls_cert else "http"
    # the agents' cluster key: $TANDEM_CLUSTER_KEY, else the one the panel keeps (never an
    # argument: a command line is there for every local user to read)
    cluster_key = settings().cluster_key
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        console.print(
            f"[red]Port {port} on {host} is in use[/]: is the panel already running? `--port` picks another "
            "(0: a free one); `--reset-admin-password` works beside a running panel."
        )
        raise typer.Exit(1) from None
    sock.listen(1024)
    port = sock.getsockname()[1]
    web = create_panel_app(data_dir, cluster_key, mdns, mdns_interface or None)
    engine, key = web.state.db, web.state.router.cluster_key
    password = ensure_admin_password(engine)
    if password:
        console.print(f"[bold]admin password[/] (shown once, stored hashed): {password}")

    async def bootstrap() -> None:
        for url in node or []:
            n = await add_node(engine, url, key)
            console.print(f"node {n.name} at {n.url}: {n.engine}, {n.model}")
        for spec in pair or []:
            name, _, urls = spec.partition("=")
            p_urls, d_urls, *options = urls.split(",")
            members = [MemberSpec(u, "prefill") for u in p_urls.split("+")]
            members += [MemberSpec(u, "decode") for u in d_urls.split("+")]
            threshold = next((int(o.split("=", 1)[1]) for o in options if o.startswith("threshold=")), 0)
            encoding = next((o for o in options if o in ENCODINGS), "raw")
            pool = await create_pool(engine, key, name, members, threshold, page_encoding=encoding)
            console.print(f"model [bold]{pool.name}[/]: prefill on {p_urls}, decode on {d_urls}")

    asyncio.run(bootstrap())
    if api_key:
        console.print(f"[bold]API key[/] {api_key}: {create_api_key(engine, api_key)}")
    if tls_cert:
        console.print(
            f"TLS certificate SHA-256 {spaced(certificate_fingerprint(tls_cert))}", emoji=False, highlight=False
        )
    if plain_on_lan:
        console.print(
            "[bold red]plain HTTP[/]: the admin password, API keys, prompts and answers cross the network readable"
        )
    console.print(
        f"Tandem panel on {scheme}://{host}:{port} · OpenAI API at {scheme}://{host}:{port}/v1"
        + (" · mDNS on" if mdns else "")
    )
    logging.getLogger("tandem.panel").info("tandem panel ready on %s://%s:%d", scheme, host, port)
    # Streams still open 5 s after Ctrl-C or SIGTERM are cancelled, not waited for (a token stream
    # can run for minutes); each is logged as cancelled and its agents let go of the request.
    # The agent's HTTP protocol (uvicorn's, plus a stall timeout): a client that stops reading its
    # answer without hanging up would otherwise hold a decode on the agents for as long as TCP waits.
    http = PageStreamProtocol.with_stall_timeout(stall_timeout)
    config = uvicorn.Config(
        web,
        log_level="warning",
        # past the idle time OpenAI's SDK (httpx: 5 s) keeps a connection to reuse: at uvicorn's
        # default, also 5 s, a client's next request could meet the panel's close on its way
        # ("Server disconnected without sending a response"); the agent keeps them 75 s too
        timeout_keep_alive=75,
        timeout_graceful_shutdown=5,
        http=http,
        limit_concurrency=MAX_CONNECTIONS,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
    )
    quiet_shutdown_cancels()  # after the Config, which sets up uvicorn's loggers
    uvicorn.Server(config).run(sockets=[sock])
