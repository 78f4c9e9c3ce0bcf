"""TLS between Tandem's processes: each agent's own certificate, and pinning it by fingerprint.

An agent makes a key pair and a self-signed certificate on first start (`ensure_certificate`) and
serves HTTPS with it. No CA vouches for it; instead its SHA-256 fingerprint (of the certificate's
DER bytes, as `openssl x509 -fingerprint -sha256` shows it) is what peers pin:

- the panel learns it at pairing, from the TLS connection itself, and accepts it only when the
  agent's identity proof (tandem_protocol/auth.py), made with the cluster key, names that very
  fingerprint — so a man in the middle, who must present his own certificate, cannot pass the
  proof on; the panel keeps it with the node and checks it on every later connection;
- a decoder is told its prefiller's fingerprint by the panel, with each request.

`client_context(pin)` checks the peer's certificate against the pin during the handshake, before
any byte of the request (and its key) is sent. It works through `SSLContext.sslobject_class`,
which every asyncio/anyio/uvloop TLS transport uses, and `sslsocket_class`, which blocking
sockets use: httpx (async or not) and the page receiver share it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import ssl
from pathlib import Path

from .errors import TandemError

CERT_DAYS = 3650  # a pinned certificate is trusted by its fingerprint, not its dates: no renewal dance


class PinMismatch(TandemError, ssl.SSLError):
    """The peer's certificate is not the one pinned for it."""


def fingerprint(der: bytes) -> str:
    """The SHA-256 of a certificate's DER bytes, lower-case hex (64 characters)."""
    return hashlib.sha256(der).hexdigest()


def spaced(fp: str) -> str:
    """A fingerprint as people compare it by eye: `AB:CD:…`."""
    return ":".join(fp[i : i + 2] for i in range(0, len(fp), 2)).upper()


def certificate_fingerprint(cert_path: Path) -> str:
    return fingerprint(ssl.PEM_cert_to_DER_cert(cert_path.read_text()))


def ensure_certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """`folder/<name>.pem` and `folder/<name>.key`: this node's certificate and private key, made on
    first use (EC P-256, self-signed, 10 years); the key file is readable by its owner alone."""
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tandem {name}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("tandem.invalid")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_pem)
    tmp = cert_path.with_suffix(".pem.tmp")  # the certificate last: its presence means the pair is whole
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tmp.replace(cert_path)
    return cert_path, key_path


def _check_pin(tls: ssl.SSLObject | ssl.SSLSocket) -> None:
    """Once a handshake is done: record the peer's certificate fingerprint on the context, and
    refuse the connection when the context pins another one."""
    context: PinnedContext = tls.context  # type: ignore[assignment]
    seen = fingerprint(tls.getpeercert(binary_form=True) or b"")
    context.seen = seen
    # `seen` itself is checked, not the context's: another handshake on the same context may write
    # its own fingerprint there in between
    if context.pin is not None and not hmac.compare_digest(seen, context.pin):
        raise PinMismatch(f"the peer's TLS certificate {seen[:16]}… is not the one pinned for it ({context.pin[:16]}…)")


class _PinnedObject(ssl.SSLObject):  # what asyncio, uvloop and anyio wrap a connection in
    def do_handshake(self) -> None:
        super().do_handshake()
        _check_pin(self)


class _PinnedSocket(ssl.SSLSocket):  # what blocking clients (httpx.Client, `socket`) wrap one in
    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_pin(self)


class PinnedContext(ssl.SSLContext):
    """A client context that trusts exactly one certificate, by fingerprint (`pin`), or, with pin
    None, records what it saw (`seen`) for the caller to check — the pairing's first contact."""

    pin: str | None = None
    seen: str | None = None


def client_context(pin: str | None) -> PinnedContext:
    ctx = PinnedContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # The pin replaces chain and name checks: the certificate is self-signed, and its name says nothing.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.sslobject_class, ctx.sslsocket_class = _PinnedObject, _PinnedSocket
    ctx.pin = pin.lower() if pin else None
    return ctx


def server_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_path, key_path)
    return ctx


def peer_fingerprint(host: str, port: int, timeout: float = 10.0) -> str:
    """The fingerprint of the certificate the server at host:port presents (nothing is sent but
    the handshake): what `tandem agent doctor` shows for a peer."""
    ctx = client_context(None)
    with socket.create_connection((host, port), timeout) as raw, ctx.wrap_socket(raw):
        return ctx.seen or ""
