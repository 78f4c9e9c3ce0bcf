"""The cluster key checks both servers make, and the identity proof an agent gives a panel.

Identity proof (`POST /v1/identity`, the one agent route besides /healthz that needs no key): the
panel sends a fresh random nonce and no key; the agent answers its node id, the address the
connection reached (its own socket's, which a client cannot choose — a Host header it could) and

    proof = HMAC-SHA256(cluster key, "tandem-identity-v2" | nonce | node id | address | TLS fingerprint)

The TLS fingerprint is the SHA-256 of the agent's own certificate ("" over plain HTTP). The panel
recomputes the proof with its own key and the fingerprint of the certificate its connection was
actually given. A match shows the answer came, for this nonce, from a holder of the cluster key
who is this node at this address and serves this certificate, so the panel may pin that
certificate, move a known node's row there and send it the key. An impostor gets no key out of it
(none was sent), cannot replay an old answer (the nonce is new every time) and cannot relay the
challenge to the real agent (who would sign its own address and certificate, not the impostor's:
a man in the middle must present a certificate of his own).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from pydantic import BaseModel, Field

IDENTITY_PATH = "/v1/identity"
_DOMAIN = b"tandem-identity-v2"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (None without one)."""
    return authorization[7:] if authorization and authorization.startswith("Bearer ") else None


def key_matches(presented: str | None, key: str) -> bool:
    """Constant-time comparison, so response timing reveals nothing about the key."""
    return presented is not None and hmac.compare_digest(presented.encode(), key.encode())


class IdentityChallenge(BaseModel):
    nonce: str = Field(pattern=r"^[0-9a-f]{32,128}$", description="Fresh random hex chosen by the caller")
    address: str | None = Field(
        None,
        max_length=300,
        description="host:port the caller reached; signed instead of the socket's own address only when "
        "the agent's operator advertised it (a port forward or proxy in front of the agent)",
    )


class IdentityAnswer(BaseModel):
    node_id: str
    address: str = Field(description="host:port the connection reached, as the agent's socket saw it")
    tls_fingerprint: str = Field("", description='SHA-256 of the agent\'s TLS certificate (hex; "" over plain HTTP)')
    proof: str = Field(description="hex HMAC-SHA256 of the cluster key over nonce, node id, address and fingerprint")


def new_nonce() -> str:
    return secrets.token_hex(32)


def canonical_address(host: str, port: int) -> str:
    """`host:port` written one way for both ends (IPv4-mapped IPv6 as IPv4, IPv6 in brackets)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return f"{host.lower()}:{port}"  # a name: compared as written
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def identity_proof(key: str, nonce: str, node_id: str, address: str, tls_fingerprint: str = "") -> str:
    # Each part length-prefixed, so no two different (nonce, id, address, fingerprint) read as the same bytes.
    parts = (nonce, node_id, address, tls_fingerprint)
    message = _DOMAIN + b"".join(len(p).to_bytes(4, "big") + p for p in (s.encode() for s in parts))
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def identity_answer(key: str, nonce: str, node_id: str, address: str, tls_fingerprint: str = "") -> IdentityAnswer:
    proof = identity_proof(key, nonce, node_id, address, tls_fingerprint)
    return IdentityAnswer(node_id=node_id, address=address, tls_fingerprint=tls_fingerprint, proof=proof)


def proof_matches(
    answer: IdentityAnswer, key: str, nonce: str, node_id: str, address: str, tls_fingerprint: str = ""
) -> bool:
    """Whether `answer` proves holding `key`, for this nonce, as `node_id` reached at `address`
    serving the certificate `tls_fingerprint` (constant time in the proof)."""
    expected = identity_proof(key, nonce, node_id, address, tls_fingerprint)
    same = answer.node_id == node_id and answer.address == address and answer.tls_fingerprint == tls_fingerprint
    # compare_digest takes str only when ASCII (else TypeError): a proof never is anything else
    return same and answer.proof.isascii() and hmac.compare_digest(answer.proof, expected)
