"""Who a client is: CURVE authentication of tcp:// endpoints, tenants and admin rights.

ipc:// endpoints rely on file permissions (0600 socket in a 0700 directory):
a local peer is trusted and admin. On tcp:// endpoints with CURVE, pyzmq's
ZAP authenticator (`zmq.auth`) checks the client's public key against an
allow-list directory; the key's file name (without `.key`) becomes the
ZeroMQ User-Id of every message on that connection, and that name is the
tenant, whatever the message says. Keys listed as admins may run admin
ops; keys listed as forwarders (balancers) are trusted to pass their
clients' `tenant` on. Without CURVE, tcp:// peers are anonymous: their
`tenant` field is taken as given and admin ops are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Peer:
    """An authenticated client key."""

    name: str
    admin: bool = False
    forwarder: bool = False


class Client(Protocol):
    """What the rules here read of a connection (engine.daemon.frontend.Conn)."""

    local: bool  # arrived on an ipc:// endpoint
    peer: Peer | None


def tenant_for(conn: Client, requested: str) -> str:
    """The tenant a request runs as: the authenticated key's, unless the key forwards for others."""
    peer = getattr(conn, "peer", None)
    if peer is None or peer.forwarder:
        return requested
    return peer.name


def is_admin(conn: Client) -> bool:
    peer = getattr(conn, "peer", None)
    return bool(conn.local or (peer is not None and peer.admin))


def refused_unless_admin(fe, conn: Client, cid, op: str) -> bool:
    """True when `conn` may not run the admin op `op`, its 403 `forbidden` already sent (by `fe`, the
    daemon's Frontend): every admin op refuses a non-admin connection in the same words."""
    if is_admin(conn):
        return False
    fe.error(conn, cid, 403, "forbidden", f"{op} needs an admin connection (ipc://, or an admin key)")
    return True


# Stats keys that name tenants; a tenant's key sees only its own entry in them.
TENANT_KEYED_STATS = ("tenant_active", "tenant_service_tokens")


def visible_stats(conn: Client, body: Any) -> Any:
    """What a connection may see of a stats tree: other tenants' entries are removed for a tenant key."""
    peer = getattr(conn, "peer", None)
    if peer is None or peer.admin or peer.forwarder:
        return body
    return _only_tenant(body, peer.name)


def _only_tenant(x: Any, tenant: str) -> Any:
    if isinstance(x, dict):
        return {k: ({t: v for t, v in x[k].items() if t == tenant} if k in TENANT_KEYED_STATS and isinstance(v, dict)
                    else _only_tenant(v, tenant)) for k, v in x.items()}
    if isinstance(x, list):
        return [_only_tenant(v, tenant) for v in x]
    return x
