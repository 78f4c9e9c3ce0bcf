"""A fake agent for the pairing attack (tests/system/test_tls.py), run as a process inside a test's
network namespace:

    python -m tests.fake_agent HOST PORT UPSTREAM_PORT MDNS_ADDR RECORD_FILE

It announces itself by mDNS as a new node ("desk-pc", a node id of its own, TLS with a certificate
of its own) and serves HTTPS at HOST:PORT, relaying every byte to the real agent at
HOST:UPSTREAM_PORT (over TLS, trusting anything) and back: whatever a panel would send a node it
pairs, it reads in the clear, and whatever proof it passes on is the real agent's. Everything
it reads is appended to RECORD_FILE as it arrives.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from tandem_protocol.discovery import Announcer
from tandem_protocol.pages import PROTOCOL_VERSION
from tandem_protocol.tls import certificate_fingerprint, client_context, ensure_certificate, server_context

FAKE_NODE_ID = "e" * 32


async def main(host: str, port: int, upstream_port: int, mdns_addr: str, record: Path) -> None:
    cert, key = ensure_certificate(Path(tempfile.mkdtemp()), "fake")

    async def handle(r, w):
        up_r, up_w = await asyncio.open_connection(host, upstream_port, ssl=client_context(None))

        async def pipe(src, dst):
            while data := await src.read(65536):
                with record.open("ab") as f:
                    f.write(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(r, up_w), pipe(up_r, w), return_exceptions=True)

    server = await asyncio.start_server(handle, host, port, ssl=server_context(cert, key))
    properties = {
        "node_id": FAKE_NODE_ID,
        "name": "desk-pc",
        "engine": "torch",
        "model": "smollm2-135m-instruct",
        "contract": "0" * 64,
        "proto": str(PROTOCOL_VERSION),
        "accel": "cpu",
        "accel_name": "",
        "tls": "1",
        "tls_fp": certificate_fingerprint(cert),
    }
    announcer = Announcer(properties, port, [host], [mdns_addr])
    await announcer.start()
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    h, p, up, m, rec = sys.argv[1:6]
    asyncio.run(main(h, int(p), int(up), m, Path(rec)))
