"""CURVE on tcp:// endpoints with pyzmq's ZAP authenticator (`zmq.auth`): key files, allow-list, peers.

Key files are the ZeroMQ certificate format `npuserve keygen` writes
(`NAME.key` public, `NAME.key_secret` secret, both 0600). The allow-list is
a directory of client `NAME.key` files; the authenticator (one thread per
process) admits only those keys and names each connection by `NAME`, which
the frontend reads as the message's User-Id and `auth.Peer` turns into a
tenant and rights. A file added to the directory is seen after a restart.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from engine.daemon.auth import Peer


@dataclass(frozen=True)
class CurveClientKeys:
    """What a DEALER needs to connect to a CURVE server."""

    public: bytes
    secret: bytes
    server_public: bytes


SECRET_KEY_ENV = "NPUSERVE_CURVE_SECRET_KEY"
SERVER_KEY_ENV = "NPUSERVE_CURVE_SERVER_KEY"


def client_keys(secret_key_file: str, server_key_file: str) -> CurveClientKeys:
    """A client's keys: its own pair (NAME.key_secret) and the server's public key (SERVER.key)."""
    public, secret = read_key_pair(secret_key_file)
    return CurveClientKeys(public, secret, read_public_key(server_key_file))


def curve_keys_from_env() -> CurveClientKeys | None:
    """Client keys from $NPUSERVE_CURVE_SECRET_KEY and $NPUSERVE_CURVE_SERVER_KEY (the CLI's way), if both set."""
    sec, srv = os.environ.get(SECRET_KEY_ENV), os.environ.get(SERVER_KEY_ENV)
    return client_keys(sec, srv) if sec and srv else None


class _AllowList:
    """pyzmq's credentials-provider interface: is this (z85) client key on the list?"""

    def __init__(self, names: dict[bytes, str]) -> None:
        self.names = names

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.names


class _NamingAuthenticator(ThreadAuthenticator):
    """The allow-list check is pyzmq's; the User-Id is the key file's name instead of the z85 key."""

    def __init__(self, ctx: zmq.Context, names: dict[bytes, str]) -> None:
        super().__init__(ctx)
        self.names = names

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(z85.encode(client_public_key), "")


def read_key_pair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a `.key_secret` file; a clear error when it is missing or has no secret."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE key pair {path}: {e} (create one with `npuserve keygen`)") from None
    if not secret:
        raise ValueError(f"{path} holds no secret key (give the .key_secret file)")
    return public, secret


def read_public_key(path: str) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE public key {path}: {e}") from None
    return public


class CurveSetup:
    """One process's CURVE roles: server on its tcp:// endpoints, and/or client to its backends."""

    def __init__(self, ctx: zmq.Context, *, server_secret_key: str = "", client_keys_dir: str = "",
                 admins: tuple[str, ...] = (), forwarders: tuple[str, ...] = (), client_secret_key: str = "") -> None:
        self.server_keys = read_key_pair(server_secret_key) if server_secret_key else None
        self.client_keys = read_key_pair(client_secret_key) if client_secret_key else None
        self.admins = frozenset(admins)
        self.forwarders = frozenset(forwarders)
        self.auth: ThreadAuthenticator | None = None
        self._peers: dict[str, Peer] = {}
        if self.server_keys is not None:
            if not client_keys_dir or not os.path.isdir(client_keys_dir):
                raise ValueError(f"client_keys_dir {client_keys_dir!r}: a directory of allowed client .key files "
                                 "is required with a server key")
            names: dict[bytes, str] = {}
            for path in sorted(glob.glob(os.path.join(client_keys_dir, "*.key"))):
                name = os.path.basename(path)[:-len(".key")]
                names[read_public_key(path)] = name  # load_certificate gives z85 already
                self._peers[name] = Peer(name, admin=name in self.admins, forwarder=name in self.forwarders)
            self.auth = _NamingAuthenticator(ctx, names)
            self.auth.start()
            # The allow-list is exactly the keys named above (one read of the directory).
            self.auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(names))

    def server_socket_options(self, sock: zmq.Socket, endpoint: str) -> bool:
        """Make `sock` a CURVE server if it will listen on tcp://; True when it did."""
        if self.server_keys is None or not endpoint.startswith("tcp://"):
            return False
        sock.curve_publickey, sock.curve_secretkey = self.server_keys
        sock.curve_server = True
        return True

    def peer(self, user_id: str | None) -> Peer | None:
        return self._peers.get(user_id or "")

    def client_keys_for(self, server_key_file: str, endpoint: str) -> CurveClientKeys | None:
        """The keys to connect to a CURVE backend; None for ipc:// or a backend without a server key."""
        if not endpoint.startswith("tcp://") or not server_key_file:
            return None
        if self.client_keys is None:
            raise ValueError(f"backend {endpoint} has a server_key but security.client_secret_key is not set")
        public, secret = self.client_keys
        return CurveClientKeys(public, secret, read_public_key(server_key_file))


    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
