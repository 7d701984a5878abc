"""The remote tier's settings (from the configuration) and its faults described in one line."""

from __future__ import annotations

from dataclasses import dataclass, field

READ_SIZE = 256 << 10  # bytes per socket read (redis-py's default, 64 KiB, costs a read and a parse per 64 KiB)


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    password: str | None = None  # overrides the URL's (``--remote-password-file``)
    cluster: bool = False
    prefix: str = "kvpool"
    ttl: float = 3600.0  # seconds; 0: keys never expire
    timeout: float = 0.05  # a fetch's deadline (the caller's), seconds
    batch_blocks: int = 256  # blocks per pipelined write round trip
    queue_bytes: int = 256 << 20  # bytes waiting to be written; beyond, the oldest are dropped
    socket_timeout: float = 2.0  # a stalled server frees the worker threads after this
    tls_ca: str = ""  # rediss://: CA certificates (PEM file) to verify the server with; "": the system's
    tls_cert: str = ""  # rediss://: client certificate (PEM file), for mutual TLS
    tls_key: str = ""  # its private key (PEM file); "": in ``tls_cert``
    #: keys the names and checks of blocks (``--remote-key-file``); None: none (anyone who reaches the server
    #: can probe and forge). Never shown: not in the repr
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config) -> "RemoteSettings":
        from kvpoold.config import read_key_file

        password = None
        if config.remote_password_file:
            with open(config.remote_password_file) as f:
                password = f.read().strip()
        secret = read_key_file(config.remote_key_file) if config.remote_key_file else None
        return cls(config.remote_url, password, config.remote_cluster, config.remote_prefix, config.remote_ttl,
                   config.remote_timeout, tls_ca=config.remote_tls_ca, tls_cert=config.remote_tls_cert,
                   tls_key=config.remote_tls_key, secret=secret)

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    def client_options(self) -> dict:
        """redis-py's keyword arguments for this store (beyond the URL)."""
        kw = dict(socket_timeout=self.socket_timeout, socket_connect_timeout=min(1.0, self.socket_timeout),
                  socket_read_size=READ_SIZE)
        if self.password is not None:
            kw["password"] = self.password
        if self.tls:  # the server's certificate is always verified, its name against the URL's host
            kw.update(ssl_cert_reqs="required", ssl_check_hostname=True)
            if self.tls_ca:
                kw["ssl_ca_certs"] = self.tls_ca
            if self.tls_cert:
                kw.update(ssl_certfile=self.tls_cert, ssl_keyfile=self.tls_key or None)
        return kw


def describe(exc: BaseException, settings: RemoteSettings) -> str:
    """A fault of the store in one line; for a TLS fault, what to check first."""
    text = f"{type(exc).__name__}: {exc}"
    if not settings.tls:
        return text
    seen = f"{text} {exc.__context__!r} {exc.__cause__!r}"
    if "Hostname mismatch" in seen or "IP address mismatch" in seen:
        hint = "the server's certificate does not name the URL's host"
    elif "CERTIFICATE_VERIFY_FAILED" in seen:
        trusted = f"--remote-tls-ca {settings.tls_ca}" if settings.tls_ca else "the system's; see --remote-tls-ca"
        hint = f"the server's certificate is not signed by a trusted CA ({trusted})"
    elif any(m in seen for m in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED")):
        hint = f"the server refused this daemon's client certificate (--remote-tls-cert {settings.tls_cert})"
    elif "SSLEOFError" in seen:  # what a server that wants a client certificate and got none (or none it
        # trusts) does to a TLS 1.3 client: it closes the connection after the handshake
        given = f"--remote-tls-cert {settings.tls_cert}" if settings.tls_cert else "none given: --remote-tls-cert"
        hint = f"the server closed the connection: does it require a client certificate it trusts ({given})?"
    elif any(m in seen for m in ("handshake operation timed out", "WRONG_VERSION_NUMBER", "record layer")):
        hint = "no TLS handshake: is the server listening with TLS on that port (not a plain one behind rediss://)?"
    else:
        return text
    return f"TLS: {hint}; {text}"
