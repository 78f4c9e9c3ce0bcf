"""Real agent and panel processes for tests (the product's own launcher), and a P/D router."""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from node_agent.identity import known_certificates
from tandem_cli.processes import TANDEM, ServiceProcess, agent_serve_args  # noqa: F401  (TANDEM is used by tests)
from tandem_protocol.tls import client_context

TEST_KEY = "tdm_test-cluster-key-0123456789abcdef"


class LocalHTTPServer(ThreadingHTTPServer):
    """A test's own HTTP server on 127.0.0.1 (a free port, or `port`), `handler` answering, served by
    a thread while it is used as a context manager (`url`: where)."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0):
        super().__init__(("127.0.0.1", port), handler)
        self.url = f"http://127.0.0.1:{self.server_port}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class AgentProcess(ServiceProcess):
    """One agent in its own process and data dir, on a free port. Use as a context manager.

    Its engine's prefix cache is off unless `prefix_cache` says otherwise ("default": the agent's
    own default): tests that repeat a prompt to check its pages, transfer or faults need every
    request's pages computed and on the wire (tests/system/test_prefix_cache.py turns it on)."""

    def __init__(
        self,
        engine: str,
        model: Path,
        home: Path,
        *args: str,
        host: str = "127.0.0.1",
        netns: str | None = None,
        key: str = TEST_KEY,
        env: dict[str, str] | None = None,
        port: int = 0,
        prefix_cache: str = "0",
        tls: bool = False,
    ):
        home.mkdir(parents=True, exist_ok=True)
        if prefix_cache != "default" and "--prefix-cache-bytes" not in args:
            args = (*args, "--prefix-cache-bytes", prefix_cache)
        self.engine, self.host, self.key, self.home, self.tls = engine, host, key, home, tls
        self.name = f"{engine}-{home.name}"
        ca = (env or {}).get("TANDEM_CA_FILE")
        self._verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        super().__init__(
            agent_serve_args(engine, model, "--name", self.name, *args, host=host, port=port, tls=tls),
            env={"TANDEM_HOME": str(home), "TANDEM_CLUSTER_KEY": key, **(env or {})},
            netns=netns,
        )

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def fingerprint(self) -> str | None:
        """The SHA-256 of the certificate the agent serves (`tls`: its own, made at its first start)."""
        return known_certificates(self.home).get(self.name) if self.tls else None

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """How a test's client trusts this agent: its pinned certificate, as a panel would."""
        return client_context(self.fingerprint) if self.tls else self._verify

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60, verify=self.verify
        )

    def info(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/info")
            r.raise_for_status()
            return r.json()

    def status(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/status")
            r.raise_for_status()
            return r.json()

    def __enter__(self) -> AgentProcess:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def side_by_side(*starts: Callable[[], ServiceProcess], timeout: float = 300) -> Iterator[list]:
    """Services started all at once and awaited together (each loads its engine while the others
    do), in the order given; every one started is stopped on the way out, also when a later one
    fails to start. `with AgentProcess(...) as a, AgentProcess(...) as b` loads a, then b."""
    with ExitStack() as stack:
        services = []
        for start in starts:
            services.append(start())
            stack.callback(services[-1].stop)
        for service in services:
            service.wait_ready(timeout)
        yield services


def log_rows(home: Path) -> list:
    """The request log of the panel whose TANDEM_HOME is `home`, oldest first."""
    from sqlmodel import Session, create_engine, select

    from control_panel.models import RequestLog

    with Session(create_engine(f"sqlite:///{home / 'panel' / 'panel.db'}")) as s:
        return list(s.exec(select(RequestLog).order_by(RequestLog.id)))


def settle(*agents: AgentProcess, timeout: float = 15.0) -> None:
    """Every agent back to idle: nothing reserved (staging, or KV admitted to decode), no open
    handoff, no active request. Freeing after a disconnect is asynchronous, so this allows a moment."""
    deadline = time.monotonic() + timeout
    while True:
        held = [
            (s["name"], s["budget"]["reserved"], s["decode"]["kv_reserved"], s["open_handoffs"], s["active_requests"])
            for s in (a.status() for a in agents)
        ]
        busy = [h for h in held if any(h[1:])]
        if not busy:
            return
        assert time.monotonic() < deadline, f"agents still hold resources: {busy}"
        time.sleep(0.1)


class PanelProcess(ServiceProcess):
    """`tandem panel` on a free port; `api_key` and `admin_password` hold what it printed once."""

    def __init__(self, home: Path, *args: str, key: str = TEST_KEY, netns: str | None = None, port: int = 0):
        extra = [] if "--mdns" in args else ["--no-mdns"]  # tests multicast only inside their namespaces
        # plain HTTP unless a certificate is asked for, as the agents the tests start (a panel bound
        # beyond loopback refuses it unless told)
        extra += [] if {"--tls", "--tls-cert", "--insecure-http"} & set(args) else ["--insecure-http"]
        super().__init__(
            ["panel", "--port", str(port), "--api-key", "tests", *args, *extra],
            env={"TANDEM_HOME": str(home), "TANDEM_CLUSTER_KEY": key, "COLUMNS": "300"},
            netns=netns,
        )
        self.wait_ready()
        keys, passwords = self.lines_matching("API key"), self.lines_matching("admin password")
        self.api_key = keys[-1].rsplit(": ", 1)[1].strip() if keys else None
        self.admin_password = passwords[-1].rsplit(": ", 1)[1].strip() if passwords else None

    def __enter__(self) -> PanelProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def pd_request(
    p_url: str,
    d_url: str,
    token_ids: list[int],
    sampling: dict,
    mode: str | None = None,
    key: str = TEST_KEY,
    prefill_url: str | None = None,
    page_encoding: str = "raw",
    d_pin: str | None = None,
    prefill_fingerprint: str | None = None,
) -> list[dict]:
    """One P/D request the way the panel sends it: one POST /v1/decode to D, which creates the
    handoff on P (at `prefill_url`, P's own URL unless a proxy sits between) and pulls its pages.
    Over TLS: `d_pin` is D's certificate, `prefill_fingerprint` P's, as the panel pins them.
    Returns D's NDJSON lines; an answer before the stream (4xx, 502) raises AgentHTTPError."""
    from tandem_protocol.client import AgentClient

    d = AgentClient(d_url, key, pin=d_pin)
    body = {"token_ids": token_ids, "sampling": sampling, "prefill_url": prefill_url or p_url}
    body |= {"page_encoding": page_encoding} | ({"mode": mode} if mode else {})
    body |= {"prefill_fingerprint": prefill_fingerprint} if prefill_fingerprint else {}
    try:
        return [line async for line in d.lines("/v1/decode", body)]
    finally:
        await d.aclose()


async def generate_request(url: str, token_ids: list[int], sampling: dict, key: str = TEST_KEY) -> list[dict]:
    """One request on an agent's engine alone (POST /v1/generate); returns its NDJSON lines."""
    from tandem_protocol.client import AgentClient

    client = AgentClient(url, key)
    try:
        return [line async for line in client.lines("/v1/generate", {"token_ids": token_ids, "sampling": sampling})]
    finally:
        await client.aclose()


def decode_foreign_pages(p: AgentProcess, d: AgentProcess, token_ids: list[int]) -> list[dict]:
    """Pages made for P's own contract, decoded by D anyway (a prefiller that skipped its contract
    check): a proxy before P rewrites D's fingerprint in the handoff request into P's. D's lines."""
    swap = (d.info()["contract"]["fingerprint"].encode(), p.info()["contract"]["fingerprint"].encode())
    proxy = TamperProxy(p.port, replace=[swap])
    try:
        return asyncio.run(pd_request(p.url, d.url, token_ids, {"max_tokens": 4}, prefill_url=proxy.url))
    finally:
        proxy.close()


def tokens_of(lines: list[dict]) -> list[int]:
    assert "error" not in lines[-1], lines[-1]
    return [line["token"] for line in lines if "token" in line]


async def pages_of(agent: AgentProcess, ids: list[int], mode: str = "commit-first") -> list:
    """Ask an agent to prefill `ids` and read its pages (KVPage) off the wire."""
    return (await prefill_of(agent, ids, mode))[0]


async def prefill_of(agent: AgentProcess, ids: list[int], mode: str = "commit-first") -> tuple[list, object]:
    """Ask an agent to prefill `ids`: its pages (KVPage) off the wire and its PrefillDone."""
    from tandem_protocol.client import AgentClient
    from tandem_protocol.pages import KVPage

    client = AgentClient(agent.url, TEST_KEY)
    try:
        info = await client.info()
        handoff_id = uuid.uuid4().hex
        created = await client.create_handoff(
            handoff_id=handoff_id,
            token_ids=ids,
            sampling={"max_tokens": 1},
            mode=mode,
            contract=info["contract"]["fingerprint"],
        )
        async with client.page_stream(handoff_id, None, token=created["read_token"]) as stream:
            items = [item async for item in stream]
        return [x for x in items if isinstance(x, KVPage)], items[-1]
    finally:
        await client.aclose()


def wait_for(what, timeout: float = 60, step: float = 0.02):
    """Until what() is true (a status read over HTTP: an agent sends no event for it); returns it."""
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)
    return value


def wait_until_streaming(p: AgentProcess, timeout: float = 120) -> str:
    """Until the prefiller has sent some but not all of a handoff's pages (the transfer is under
    way); returns its id. (A server engine may finish its prefill before its first page is sent:
    what counts is what is left to send.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        handoffs = p.status()["handoffs"]
        if handoffs and 1 <= handoffs[0]["pages_sent"] < handoffs[0]["prompt_tokens"] // 64:
            return handoffs[0]["handoff_id"]
        time.sleep(0.05)
    raise AssertionError(f"no transfer under way on {p.url}")


def complete(client, model: str, ids: list[int], stream: bool, max_tokens: int = 16) -> str:
    args = dict(model=model, prompt=ids, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))


RELEASE_PIECE = 1 << 20  # bytes a held stream's release writes at a time
UPSTREAM_RCVBUF = 1 << 18  # a frozen link's receive buffer (the kernel doubles it)


def reserved_port() -> socket.socket:
    """A loopback port held from now on, bound but not listening, for a proxy to listen on later
    (TamperProxy(sock=...)): a port only picked (free_port) was free when picked, and the other
    lane's agents, panels and servers starting meanwhile could be handed it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class TamperProxy:
    """A TCP proxy that damages what the upstream sends back: flip one bit at byte `flip_at`,
    cut the connection after `cut_at` bytes, go silent after `freeze_at` bytes (a pulled cable:
    no byte and no close either way, until the client gives up), or pass at most `rate` bytes a
    second (a slow link). All counted per connection and read when a connection opens, so a
    test may change them between requests. `hold_pages()`: page streams opened from then on
    are read from the upstream at once but kept back until `release_pages()` (a prefiller
    that has staged every page before its reader sees one). `replace`: (old, new) byte strings of equal length
    replaced in what the client sends (a request rewritten on its way). `recorded`: every byte
    that crossed it, both ways (what an eavesdropper on the link would have). Runs its own event
    loop in a thread."""

    def __init__(
        self,
        upstream_port: int,
        flip_at: int | None = None,
        cut_at: int | None = None,
        upstream_host: str = "127.0.0.1",
        host: str = "127.0.0.1",
        port: int = 0,
        replace: list[tuple[bytes, bytes]] = (),
        scheme: str = "http",
        sock: socket.socket | None = None,
    ):
        assert all(len(old) == len(new) for old, new in replace), "a rewrite keeps the Content-Length"
        self.scheme, self.recorded = scheme, bytearray()
        self.upstream_port, self.flip_at, self.cut_at, self.replace = upstream_port, flip_at, cut_at, replace
        self.freeze_at: int | None = None
        self.rate: float | None = None
        self._held: asyncio.Event | None = None  # set: the held page streams go on
        self.upstream_host, self.host, self.port = upstream_host, host, port
        self.sock = sock  # a socket bound earlier (reserved_port): it listens on that
        if sock is not None:
            self.host, self.port = sock.getsockname()[:2]
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: BaseException | None = None  # why the listening socket could not be opened
        threading.Thread(target=self._run, daemon=True).start()
        # a port picked earlier (port=...) may have been taken since: say so here, not as an
        # unrelated fault later
        assert self._ready.wait(30), f"TamperProxy on {host}:{port} did not start listening in 30 s"
        if self._failed is not None:
            raise RuntimeError(f"TamperProxy could not listen on {host}:{port}: {self._failed}") from self._failed

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            where = {"sock": self.sock} if self.sock is not None else {"host": self.host, "port": self.port}
            self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, **where))
        except BaseException as e:  # e.g. EADDRINUSE
            self._failed = e
            self._ready.set()
            self.loop.close()
            return
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _connect_upstream(self, small_buffer: bool):
        """A frozen link must stop the upstream's bytes at a known point: loopback TCP autotunes its
        receive buffer up to net.ipv4.tcp_rmem's maximum (32 MiB on CI-like machines, a whole
        16-page prompt), so a frozen connection's is fixed small (set before connect: that is
        what keeps autotuning off)."""
        if not small_buffer:
            return await asyncio.open_connection(self.upstream_host, self.upstream_port)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RCVBUF)
        sock.setblocking(False)
        try:
            await self.loop.sock_connect(sock, (self.upstream_host, self.upstream_port))
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def _handle(self, client_r, client_w) -> None:
        flip_at, cut_at, freeze_at, rate = self.flip_at, self.cut_at, self.freeze_at, self.rate
        up_r, up_w = await self._connect_upstream(small_buffer=freeze_at is not None)
        first = await client_r.read(65536)  # a page stream's connection carries nothing else
        held = self._held if re.match(rb"GET /v1/handoffs/\w+/pages ", first) else None
        chunks: asyncio.Queue[bytes] = asyncio.Queue()  # what a held stream's upstream sent

        async def upstream() -> None:
            data = first
            while data:
                for old, new in self.replace:
                    data = data.replace(old, new)
                self.recorded += data
                up_w.write(data)
                await up_w.drain()
                data = await client_r.read(65536)

        async def stage() -> None:
            while data := await up_r.read(65536):
                self.recorded += data
                chunks.put_nowait(data)
            chunks.put_nowait(b"")

        async def release() -> None:  # what is held, at once: the client gets it at loopback speed
            await held.wait()
            while True:
                parts = [await chunks.get()]
                while parts[-1] and not chunks.empty():
                    parts.append(chunks.get_nowait())
                held_bytes = memoryview(b"".join(parts))
                # in pieces: asyncio's transport copies what a write cannot send at once, and
                # on 3.11 shifts its whole buffer after every send (one 35 MB write: ~0.3 GB/s)
                for at in range(0, len(held_bytes), RELEASE_PIECE):
                    client_w.write(held_bytes[at : at + RELEASE_PIECE])
                    await client_w.drain()
                if not parts[-1]:
                    return

        async def downstream() -> None:
            sent, t0 = 0, time.monotonic()
            while data := await up_r.read(16384 if rate else 65536):
                self.recorded += data
                data = bytearray(data)
                if flip_at is not None and sent <= flip_at < sent + len(data):
                    data[flip_at - sent] ^= 0x04
                if cut_at is not None and sent + len(data) >= cut_at:
                    client_w.write(bytes(data[: cut_at - sent]))
                    return
                if freeze_at is not None and sent + len(data) >= freeze_at:
                    client_w.write(bytes(data[: freeze_at - sent]))
                    await asyncio.Event().wait()  # silent until the client closes (upstream() ends)
                client_w.write(bytes(data))
                sent += len(data)
                await client_w.drain()
                if rate:  # hold the average at `rate`: TCP back-pressure reaches the upstream
                    await asyncio.sleep(max(0.0, t0 + sent / rate - time.monotonic()))

        ends = [upstream(), release() if held is not None else downstream()]
        tasks = [asyncio.ensure_future(c) for c in ends]
        staging = [asyncio.ensure_future(stage())] if held is not None else []
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when set_faults() cancels this connection: both ends see it close
            for t in tasks + staging:
                t.cancel()
            for w in (client_w, up_w):
                w.close()

    def set_faults(self, flip_at=None, cut_at=None, freeze_at=None, rate=None) -> None:
        """Damage every connection opened from now on (all None: none), and close those open now:
        a client's pooled connection would otherwise keep the faults it was opened with."""
        self.flip_at, self.cut_at, self.freeze_at, self.rate = flip_at, cut_at, freeze_at, rate
        asyncio.run_coroutine_threadsafe(self._drop_connections(), self.loop).result(10)

    def hold_pages(self) -> None:
        self._held = asyncio.Event()

    def release_pages(self) -> None:
        held, self._held = self._held, None
        self.loop.call_soon_threadsafe(held.set)

    async def _drop_connections(self) -> None:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # closed by the time set_faults returns

    def close(self) -> None:
        async def shut() -> None:
            self.server.close()
            await self._drop_connections()

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
