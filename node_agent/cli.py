"""`tandem agent …`: run a node agent and diagnose one."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tandem_protocol.auth import canonical_address
from tandem_protocol.page_memory import keep_freed_pages
from tandem_protocol.pages import PROTOCOL_VERSION
from tandem_protocol.settings import AGENT_PORT, data_dir, hash_cache_path, settings
from tandem_protocol.tls import certificate_fingerprint, client_context, ensure_certificate, peer_fingerprint, spaced
from tandem_protocol.wire import HEARTBEAT_SECONDS

from .admission import MAX_SEQUENCES, WAIT_SECONDS
from .identity import (
    NodeIdInUse,
    claim_node_id,
    cluster_key,
    key_path,
    known_certificates,
    known_node_ids,
    new_cluster_key,
    node_id_path,
    set_cluster_key,
    tls_dir,
)

# On Ctrl-C or SIGTERM, requests still streaming after this long are cancelled (each releases what
# it holds on the way out) instead of being waited for: a token stream can run for minutes.
GRACEFUL_SHUTDOWN_SECONDS = 5.0
# Connections at once: at the limit the one that has waited longest for a request is closed to
# make room (tandem_protocol/http_server.py); 503 only when every one is being answered. A desk's
# agent serves a few panels' polls, its peers' page streams and its decodes.
MAX_CONNECTIONS = 256

app = typer.Typer(help="Run and diagnose a node agent.", no_args_is_help=True)
console = Console()
DEFAULT_PORT = AGENT_PORT

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """'512MiB', '1.5GB', '1048576' -> bytes."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"not a size: {text!r} (try 512MiB or 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resolve_model(model: str | None) -> Path:
    """A model directory, a registered model name, or (default) the embedded model."""
    if model and Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve()
    from .model_registry import ModelRegistry

    if model:
        try:
            return ModelRegistry().get(model).path
        except KeyError as e:
            raise typer.BadParameter(str(e)) from None
    from engine_adapters.embedded_model import is_fetched, model_dir

    if not is_fetched(data_dir()):
        raise typer.BadParameter("no --model given and the embedded model is not fetched: run `tandem model fetch`")
    return model_dir(data_dir())


def _host_port(text: str) -> str:
    """An --advertise-address as the identity proof writes addresses (canonical host:port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise typer.BadParameter(f"--advertise-address {text!r}: expected HOST:PORT")
    return canonical_address(host, int(port))


@app.command()
def serve(
    engine: str = typer.Option("torch", help="Engine: torch or mlx."),
    model: str = typer.Option(None, help="Model directory or registered name (default: embedded SmolLM2)."),
    context_length: int = typer.Option(None, help="Context length (default: the model's)."),
    staging_bytes: str = typer.Option("512MiB", help="KV staging budget, e.g. 512MiB or 2GB."),
    decode_kv_bytes: str = typer.Option(
        None,
        help="KV the decoder admits at once (prompt plus max_tokens of every running request, FP16), e.g. "
        "4GiB (default: the engine's share of its memory).",
    ),
    max_sequences: int = typer.Option(MAX_SEQUENCES, min=1, help="Requests the decoder runs at once."),
    prefix_cache_bytes: str = typer.Option(
        None,
        help="KV of recent prompts and answers the engine keeps for the next turn of a conversation, e.g. "
        "2GiB; 0 keeps none (default: an eighth of the memory free once the model is loaded).",
    ),
    admission_wait: float = typer.Option(
        WAIT_SECONDS, min=0, help="Seconds a request may wait for the decoder's room before it is answered 429."
    ),
    host: str = typer.Option("0.0.0.0", help="Address to listen on."),
    port: int = typer.Option(DEFAULT_PORT, help="Port to listen on."),
    name: str = typer.Option(
        None, help="Node name (default: the host name); agents sharing a data dir need different names."
    ),
    node_id_file: Path = typer.Option(
        None, help="Where this agent keeps its lasting node id (default: $TANDEM_HOME/node-ids/<name>)."
    ),
    mdns: bool = typer.Option(True, help="Announce this agent on the LAN with mDNS."),
    mdns_interface: list[str] = typer.Option(None, help="Interface address(es) for mDNS (default: all)."),
    handoff_ttl: float = typer.Option(60.0, help="Seconds before unread pages expire."),
    stall_timeout: float = typer.Option(
        60.0,
        min=2 * HEARTBEAT_SECONDS,
        help="Seconds a page stream may move no byte before both ends give it up (a pulled cable, a frozen "
        "peer; a prefiller still computing sends a heartbeat every second).",
    ),
    page_sender: str = typer.Option(
        "thread",
        help="Who writes a page stream's frames to the socket: `thread` (a thread of its own, off the "
        "event loop and its GIL; the default) or `loop` (the event loop's transport).",
    ),
    advertise_address: list[str] = typer.Option(
        None,
        help="HOST:PORT this agent is also reached at (a port forward or proxy in front of it): it proves "
        "its identity there too. Without it a panel can only add it by an address it listens on.",
    ),
    device: str = typer.Option(None, help="torch only: cuda, cuda:N or cpu."),
    tls_cert: Path = typer.Option(
        None, help="TLS certificate (PEM) to serve HTTPS with (default: this node's own, made on first start)."
    ),
    tls_key: Path = typer.Option(None, help="TLS private key (PEM) of --tls-cert."),
    insecure_http: bool = typer.Option(
        False,
        "--insecure-http",
        help="Serve plain HTTP: anyone on the network can read the prompts, pages and cluster key. "
        "Only for a link nobody else can reach; the panel shows such nodes with a warning.",
    ),
    model_root: list[Path] = typer.Option(
        None,
        help="Directory a panel may load models from (repeatable; "
        "default: $TANDEM_HOME/models, registered models and --model).",
    ),
) -> None:
    """Host one engine and serve prefill/decode to peers."""
    import uvicorn

    from engine_adapters import load_adapter
    from engine_adapters.settings import EngineSettings
    from tandem_protocol.contract import HashCache
    from tandem_protocol.discovery import Announcer, announced_properties, lan_addresses
    from tandem_protocol.http_server import (
        PageStreamProtocol,
        quiet_shutdown_cancels,
        raise_open_file_limit,
        server_tls_context,
    )
    from tandem_protocol.settings import load

    from .app import AgentConfig, create_app
    from .model_roots import default_roots

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_file_limit()  # MAX_CONNECTIONS sockets, beside the files and the engine's
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("give both --tls-cert and --tls-key, or neither")
    if insecure_http and tls_cert:
        raise typer.BadParameter("--insecure-http serves no certificate: drop --tls-cert/--tls-key, or it")
    if page_sender not in ("thread", "loop"):
        raise typer.BadParameter("--page-sender is `thread` or `loop`")
    path = resolve_model(model)
    name = name or socket.gethostname()
    try:  # the lock is held until the process exits
        own_id, _id_lock = claim_node_id(node_id_file.expanduser() if node_id_file else node_id_path(name))
    except NodeIdInUse as e:
        raise typer.BadParameter(str(e)) from None
    if not insecure_http and tls_cert is None:
        tls_cert, tls_key = ensure_certificate(tls_dir(), own_id)
    fingerprint = certificate_fingerprint(tls_cert) if tls_cert else ""
    # Bind before loading anything: a taken port fails at once, `--port 0` picks a free one, and
    # the "ready" line is only logged once connections can be accepted.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    port = sock.getsockname()[1]

    keep_freed_pages()  # every request's pages reuse the last one's memory (page_memory.py)
    engine_settings = load(EngineSettings)  # read once, at start: every engine this agent loads gets them
    prefix_budget = parse_size(prefix_cache_bytes) if prefix_cache_bytes else None
    if prefix_budget == 0:  # vLLM's and SGLang's caches are a start-up option
        engine_settings = engine_settings.model_copy(update={"prefix_caching": False})

    def loader(engine: str, path: Path, context_length: int | None):
        kwargs = {"device": device} if device and engine == "torch" else {}
        return load_adapter(
            engine, path, context_length, engine_settings, hash_cache=HashCache(hash_cache_path()), **kwargs
        )

    with console.status(f"loading {engine} on {path.name}…"):
        adapter = loader(engine, path, context_length)
    config = AgentConfig(
        node_id=own_id,
        name=name,
        cluster_key=cluster_key(),
        staging_bytes=parse_size(staging_bytes),
        decode_kv_bytes=parse_size(decode_kv_bytes) if decode_kv_bytes else None,
        max_sequences=max_sequences,
        admission_wait=admission_wait,
        prefix_cache_bytes=prefix_budget,
        handoff_ttl=handoff_ttl,
        model_name=path.name,
        stall_timeout=stall_timeout,
        advertised=frozenset(_host_port(a) for a in advertise_address or []),
        url=f"{'https' if tls_cert else 'http'}://{host}:{port}",
        tls_fingerprint=fingerprint,
        model_roots=default_roots(path) + [p.expanduser().resolve() for p in model_root or []],
    )
    announcer = None
    if mdns:
        addresses = [host] if host not in ("0.0.0.0", "") else lan_addresses()
        announcer = Announcer(announced_properties(config, adapter), port, addresses, mdns_interface or None)
    scheme = "https" if tls_cert else "http"
    console.print(
        f"[bold]Tandem agent[/] {config.name} ({config.node_id[:8]}) · {adapter.name} · {path.name} · "
        f"contract {adapter.contract.fingerprint[:16]} · {scheme}://{host}:{port} · "
        f"key: `tandem agent key`" + (" · mDNS on" if mdns else "")
    )
    if fingerprint:
        console.print(f"TLS certificate SHA-256 {spaced(fingerprint)}", emoji=False, highlight=False)
    else:
        console.print("[bold red]plain HTTP[/]: prompts, pages and the cluster key cross the network readable")
    agent = create_app(adapter, config, announcer, loader)
    tls_context = server_tls_context(tls_cert, tls_key) if tls_cert and page_sender == "thread" else None
    try:
        server = uvicorn.Server(
            uvicorn.Config(
                agent,
                log_level="warning",
                http=PageStreamProtocol.configured(stall_timeout, sender=page_sender, tls=tls_context),
                timeout_keep_alive=75,
                limit_concurrency=MAX_CONNECTIONS,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
                # TLS served by uvloop, or (a sender thread) by the protocol's own TLS layer
                ssl_certfile=str(tls_cert) if tls_cert and tls_context is None else None,
                ssl_keyfile=str(tls_key) if tls_key and tls_context is None else None,
            )
        )
        quiet_shutdown_cancels()
        server.run(sockets=[sock])
    finally:
        if agent.state.agent.slot.ready:  # the engine now serving (a panel may have switched it)
            agent.state.agent.slot.adapter.close()


@app.command()
def key(
    set_: bool = typer.Option(
        False,
        "--set",
        help="Set this node's cluster key (share one key across a cluster): paste it when asked, or give it "
        "on standard input (`tandem agent key --set < file`). Never as an argument, which any local user can read.",
    ),
    path_only: bool = typer.Option(False, "--path", help="Print where the key is kept."),
    rotate: bool = typer.Option(
        False,
        "--rotate",
        help="Replace the cluster key with a new random one (a key that may have leaked): restart this "
        "machine's agents, give the new key to every other machine (`--set`) and to the panel.",
    ),
) -> None:
    """Show (or set, or rotate) this node's cluster key."""
    if set_ and rotate:
        raise typer.BadParameter("--set or --rotate, not both")
    if rotate:
        if settings().cluster_key:
            raise typer.BadParameter("TANDEM_CLUSTER_KEY is set: the key comes from the environment, change it there")
        set_cluster_key(new_cluster_key())
        print(
            "new cluster key written: restart this machine's agents; set it on every other machine "
            "(`tandem agent key --set`) and give it to the panel (TANDEM_CLUSTER_KEY at its next start)",
            file=sys.stderr,
        )
    if set_:
        given = typer.prompt("cluster key", hide_input=True) if sys.stdin.isatty() else sys.stdin.readline()
        try:
            set_cluster_key(given.strip())
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--set") from None
    print(key_path() if path_only else cluster_key())
    # on stderr: `$(tandem agent key)` stays the key alone
    for name, fp in known_certificates().items():
        print(f"TLS certificate of agent {name}: SHA-256 {spaced(fp)}", file=sys.stderr)


# The diagnostics send the cluster key, so they trust an agent as the panel does: over HTTPS, by
# its certificate's fingerprint, checked in the handshake before any byte of the request.
LOCAL_AGENT = f"https://127.0.0.1:{DEFAULT_PORT}"
HOW_TO_PIN = (
    "The agent prints its fingerprint when it starts (`TLS certificate SHA-256 AB:CD:…`), as do `tandem agent key` "
    "(on stderr) and `tandem agent doctor` on its machine: compare, then pass it with --fingerprint."
)
FINGERPRINT_HELP = (
    # no "AB:CD:" here: help is rich markup, where ":cd:" is an emoji
    "SHA-256 of the agent's TLS certificate, as the agent prints it at start (colons optional), pinned before the "
    "cluster key is sent (default: one of the certificates of this machine's agents, in $TANDEM_HOME)."
)
INSECURE_HTTP_HELP = (
    "Allow an http:// URL, for an agent started with --insecure-http: the cluster key then crosses the network "
    "readable. Only for a link nobody else can reach."
)


def _pin(text: str) -> str:
    """A fingerprint as given (`AB:CD:…` or 64 hex digits) in the lower-case hex the pins compare."""
    fp = text.replace(":", "").strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", fp):
        raise typer.BadParameter(
            "expected a SHA-256 fingerprint: 64 hex digits, colons allowed", param_hint="--fingerprint"
        )
    return fp


def _trust(url: str, fingerprint: str | None, insecure_http: bool) -> ssl.SSLContext | bool:
    """How the agent at `url` is trusted before the cluster key is sent to it: over HTTPS a context
    pinned to its certificate, `fingerprint` or else one of this machine's own agents' (so the
    default URL reaches the local agent), once a handshake that sends nothing has shown it; plain
    HTTP only when told `--insecure-http`. Anything else is refused, the key unsent."""
    parts = urlsplit(url)
    if parts.scheme == "http":
        if fingerprint:
            raise typer.BadParameter("--fingerprint pins a TLS certificate: the URL must be https://")
        if not insecure_http:
            raise typer.BadParameter(
                f"{url} is plain HTTP, where the cluster key crosses the network readable: the key was not sent. "
                "Agents serve HTTPS unless started with --insecure-http: use https://, or pass --insecure-http "
                "for an agent started with it."
            )
        return True  # plain HTTP: no certificate to check
    if parts.scheme != "https" or not parts.hostname:
        raise typer.BadParameter(f"{url}: expected https://HOST:PORT")
    known = {_pin(fingerprint)} if fingerprint else set(known_certificates().values())
    if not known:
        raise typer.BadParameter(
            f"no TLS certificate is known here for {url}, so the cluster key was not sent. {HOW_TO_PIN}"
        )
    try:
        seen = peer_fingerprint(parts.hostname, parts.port or 443)
    except OSError as e:  # refused, unreachable, or no TLS there (an agent started with --insecure-http)
        console.print(
            f"[red]{escape(url)}: no TLS handshake ({escape(str(e))}); the cluster key was not sent.[/] "
            "An agent started with --insecure-http serves http:// (and takes --insecure-http here too)."
        )
        raise typer.Exit(1) from None
    if seen not in known:
        expected = "the one given with --fingerprint" if fingerprint else "one of this machine's agents'"
        raise typer.BadParameter(
            f"{url} presents the TLS certificate {spaced(seen)}, not {expected}: the cluster key was not sent. "
            + HOW_TO_PIN
        )
    return client_context(seen)  # pinned: a later connection to another certificate fails before sending


def _client(url: str, trust: ssl.SSLContext | bool) -> httpx.Client:
    return httpx.Client(
        base_url=url.rstrip("/"),
        timeout=10,
        verify=trust,
        headers={
            "Authorization": f"Bearer {cluster_key()}",
            "X-Tandem-Protocol": str(PROTOCOL_VERSION),
        },
    )


def _rtt_ms(url: str, trust: ssl.SSLContext | bool, tries: int = 5) -> float:
    with httpx.Client(timeout=5, verify=trust) as c:
        samples = []
        for _ in range(tries):
            t0 = time.perf_counter()
            c.get(url.rstrip("/") + "/healthz").raise_for_status()
            samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


@app.command()
def status(
    url: str = typer.Argument(LOCAL_AGENT, help="Agent URL (default: this machine's agent)."),
    fingerprint: str = typer.Option(None, help=FINGERPRINT_HELP),
    insecure_http: bool = typer.Option(False, "--insecure-http", help=INSECURE_HTTP_HELP),
) -> None:
    """Show an agent's engine, model, budget and totals."""
    with _client(url, _trust(url, fingerprint, insecure_http)) as c:
        r = c.get("/v1/status")
    if r.status_code != 200:
        console.print(f"[red]{url} answered {r.status_code}:[/] {r.text}")
        raise typer.Exit(1)
    s = r.json()
    table = Table(show_header=False)
    b, d = s["budget"], s["decode"]
    rows = [
        ("node", f"{s['name']} ({s['node_id'][:8]})"),
        ("engine", s["engine"]),
        ("accelerator", f"{s['accelerator']['kind']} · {s['accelerator'].get('name', '')}"),
        ("model", f"{s['model']} (context {s['context_length']})"),
        ("contract", s["contract"]["fingerprint"]),
        ("protocol", str(s["protocol_version"])),
        ("budget", f"{b['reserved']:,} of {b['capacity']:,} bytes reserved, {b['waiting']} waiting"),
        (
            "decoding",
            f"{d['running']} of {d['max_sequences']} running, {d['waiting']} waiting, "
            f"KV {d['kv_reserved']:,} of {d['kv_capacity']:,} bytes",
        ),
        ("open handoffs", str(s["open_handoffs"])),
        ("active requests", str(s["active_requests"])),
    ]
    if pc := s.get("prefix_cache"):
        hits = f"{pc['hit_tokens']:,} of {pc['lookup_tokens']:,} prompt tokens reused"
        rows.append(("prefix cache", f"{pc['bytes']:,} of {pc['capacity']:,} bytes ({pc['pages']} pages), {hits}"))
    rows += [(k.replace("_", " "), f"{v:,.0f}") for k, v in s["totals"].items()]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


@app.command()
def peers(
    seconds: float = typer.Option(3.0, help="How long to listen."),
    interface: list[str] = typer.Option(None, help="Interface address(es) to browse on."),
) -> None:
    """Find agents on the LAN by mDNS and measure their round-trip time."""
    from tandem_protocol.discovery import browse

    with console.status(f"listening for agents for {seconds:.0f} s…"):
        found = asyncio.run(browse(seconds, interface or None))
    table = Table("name", "url", "engine", "accelerator", "model", "contract", "proto", "rtt")
    for p in found:
        try:  # /healthz sends nothing secret: the certificate the agent announces is enough to reach it
            tls_fp = p.properties.get("tls_fp") if p.url.startswith("https://") else None
            rtt = f"{_rtt_ms(p.url, client_context(tls_fp) if tls_fp else True):.2f} ms"
        except httpx.HTTPError as e:
            rtt = f"unreachable ({type(e).__name__})"
        pr = p.properties
        table.add_row(
            pr.get("name", "?"),
            p.url,
            pr.get("engine", "?"),
            f"{pr.get('accel', '?')} {pr.get('accel_name', '')}".strip(),
            pr.get("model", "?"),
            pr.get("contract", "")[:16],
            pr.get("proto", "?"),
            rtt,
        )
    console.print(table if found else "[yellow]no agents answered[/]")


@app.command("bench-link")
def bench_link(
    url: str = typer.Argument(..., help="Agent URL to pull synthetic pages from."),
    pages: int = typer.Option(200, help="How many pages to pull."),
    fingerprint: str = typer.Option(None, help=FINGERPRINT_HELP),
    insecure_http: bool = typer.Option(False, "--insecure-http", help=INSECURE_HTTP_HELP),
) -> None:
    """Measure page throughput and round-trip time to an agent."""
    trust = _trust(url, fingerprint, insecure_http)
    rtt = _rtt_ms(url, trust)
    with _client(url, trust) as c:
        t0 = time.perf_counter()
        total = 0
        with c.stream("GET", "/v1/bench/pages", params={"count": pages}, timeout=None) as r:
            if r.status_code != 200:
                console.print(f"[red]{url} answered {r.status_code}[/]")
                raise typer.Exit(1)
            for chunk in r.iter_raw():
                total += len(chunk)
        seconds = time.perf_counter() - t0
    console.print(
        f"{url}: rtt {rtt:.2f} ms · {pages} pages, {total / 1e6:.1f} MB in {seconds:.2f} s · "
        f"{total / seconds / 1e6:.0f} MB/s"
    )


@app.command()
def doctor(
    model: str = typer.Option(None, help="Model directory or name to check (default: embedded)."),
    port: int = typer.Option(DEFAULT_PORT, help="Port the agent would listen on."),
) -> None:
    """Check this machine: versions, engines, accelerators, model, data dir, port, network."""
    from engine_adapters.doctor import accelerators, engine_imports, environment, package_versions
    from engine_adapters.settings import EngineSettings
    from tandem_protocol.discovery import lan_addresses
    from tandem_protocol.settings import load, settings

    def section(title: str, rows: list[tuple[str, str]]) -> None:
        table = Table(title=title, show_header=False, title_justify="left")
        for k, v in rows:
            table.add_row(k, v)
        console.print(table)

    engine_settings = load(EngineSettings)
    section("packages", list(package_versions().items()))
    variables = Table("variable", "value", "meaning", title="environment", title_justify="left")
    for row in environment(settings(), engine_settings):
        variables.add_row(*row)
    console.print(variables)
    with console.status("importing engines…"):
        engines = engine_imports(engine_settings)
    section("engines", [(k, f"[green]{v}[/]" if v.startswith("ok") else f"[red]{v}[/]") for k, v in engines.items()])
    section("accelerators", list(accelerators().items()))
    try:
        path = resolve_model(model)
        from tandem_protocol.contract import HashCache, compute_contract
        from tandem_protocol.model_dir import inspect_model

        info = inspect_model(path)
        contract = compute_contract(info, info.max_context, HashCache(hash_cache_path()))
        section(
            "model",
            [
                ("path", str(path)),
                ("type", info.model_type),
                (
                    "geometry",
                    f"{info.geometry.layers} layers × {info.geometry.kv_heads} KV heads × "
                    f"{info.geometry.head_dim}, {info.geometry.page_bytes:,} bytes/page",
                ),
                ("contract", contract.fingerprint),
            ],
        )
    except Exception as e:
        section("model", [("problem", f"[red]{e}[/]")])
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            port_state = "[green]free[/]"
        except OSError as e:
            port_state = f"[yellow]in use ({e.strerror})[/]"
    section(
        "node",
        [
            ("data dir", str(data_dir())),
            *((f"node id of {n}", i) for n, i in known_node_ids().items()),
            # as Text, as is: a fingerprint's ":cd:" is no emoji
            *((f"TLS certificate of {n}", Text(spaced(fp))) for n, fp in known_certificates().items()),
            ("cluster key file", str(key_path())),
            (f"port {port}", port_state),
            ("mDNS interfaces", ", ".join(lan_addresses()) or "none"),
        ],
    )
