"""The remote tier's settings: its Redis URL (checked and redacted), key file and TLS files."""

from __future__ import annotations

import importlib.util
import os
import stat
import urllib.parse

from .limits import MAX_SECONDS
from .options import Config, ConfigError

REMOTE_SCHEMES = ("redis", "rediss", "unix")
# The remote tier's secret: 128 bits at least; far more is no key file (a path given by mistake).
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096


def validate_remote(cfg: Config, bad) -> None:
    if cfg.remote_url:
        why = check_url(cfg.remote_url)
        if why:
            raise ConfigError(f"remote_url = {redacted(cfg.remote_url)!r}: {why}")
        if importlib.util.find_spec("redis") is None:
            raise ConfigError("remote_url needs the redis package: pip install 'kvpool[remote]'")
    elif cfg.events_stream:
        raise bad("events_stream", "needs remote_url (the stream lives on the remote tier's server)")
    elif cfg.remote_key_file:
        raise bad("remote_key_file", "needs remote_url (it keys the remote tier)")
    if cfg.remote_password_file and not os.access(cfg.remote_password_file, os.R_OK):
        raise bad("remote_password_file", "cannot be read")
    if cfg.remote_key_file:
        try:
            read_key_file(cfg.remote_key_file)
        except ValueError as exc:
            raise bad("remote_key_file", str(exc)) from None
    validate_tls(cfg, bad)
    if not cfg.remote_prefix or any(c.isspace() for c in cfg.remote_prefix):
        raise bad("remote_prefix", "must be a non-empty string without spaces")
    if not 0 <= cfg.remote_ttl <= MAX_SECONDS:
        raise bad("remote_ttl", "must be between 0 (no expiry) and a year, in seconds")
    if not 0 < cfg.remote_timeout <= 60:
        raise bad("remote_timeout", "must be in (0, 60] seconds")
    if cfg.remote_write not in ("through", "evict"):
        raise bad("remote_write", "must be through or evict")


def read_key_file(path: str) -> bytes:
    """The remote tier's secret in ``path``, without surrounding whitespace (a trailing newline).

    The file must be a regular file of this process's user that no group or other user may read or
    write (the secret lets whoever holds it write blocks every daemon serves to its models), holding at
    least ``MIN_KEY_BYTES`` bytes; else ValueError saying why (never what it holds).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror})") from None
    try:
        st = os.fstat(fd)  # of the file opened: nothing can swap it between the check and the read
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"is owned by uid {st.st_uid}, not by the daemon's user (uid {os.geteuid()}): chown it")
        if st.st_mode & 0o077:
            raise ValueError(f"has mode {stat.S_IMODE(st.st_mode):o}: group and others must have no access "
                             f"(chmod 600)")
        secret = os.read(fd, MAX_KEY_BYTES + 1).strip()
    finally:
        os.close(fd)
    if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
        raise ValueError(f"holds {len(secret)} bytes of key; {MIN_KEY_BYTES} to {MAX_KEY_BYTES} are needed "
                         f"(e.g. head -c 32 /dev/urandom > FILE)")
    return secret


def validate_tls(cfg: Config, bad) -> None:
    """The TLS files: only with a rediss:// URL, readable, and certificates and keys that load."""
    import ssl

    keys = [k for k in ("remote_tls_ca", "remote_tls_cert", "remote_tls_key") if getattr(cfg, k)]
    if not keys:
        return
    if urllib.parse.urlsplit(cfg.remote_url).scheme != "rediss":
        raise bad(keys[0], "needs a rediss:// remote_url (TLS)")
    for key in keys:
        if not os.access(getattr(cfg, key), os.R_OK):
            raise bad(key, "cannot be read")
    if cfg.remote_tls_key and not cfg.remote_tls_cert:
        raise bad("remote_tls_key", "needs remote_tls_cert (the client certificate it belongs to)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cfg.remote_tls_ca:
        try:
            context.load_verify_locations(cafile=cfg.remote_tls_ca)
        except (ssl.SSLError, ValueError) as exc:
            raise bad("remote_tls_ca", f"holds no PEM certificate ({exc})") from None
    if cfg.remote_tls_cert:
        try:
            context.load_cert_chain(cfg.remote_tls_cert, cfg.remote_tls_key or None)
        except (ssl.SSLError, ValueError) as exc:
            raise bad("remote_tls_cert", f"no PEM certificate with its private key (remote_tls_key) ({exc})") from None


def redacted(url: str) -> str:
    try:
        return redact(url)
    except ValueError:
        return "<unparsable URL>"


def redact(url: str) -> str:
    """``url`` without its password (for logs and stats)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.hostname or ""
    if parts.username:
        netloc = f"{parts.username}:***@{netloc}"
    else:
        netloc = f":***@{netloc}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_url(url: str) -> str:
    """Why ``url`` is no Redis URL ("" if it is one): ``redis://``, ``rediss://`` or ``unix://``."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in REMOTE_SCHEMES:
        return f"the scheme must be one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}"
    if parts.scheme == "unix":
        if not parts.path:
            return "unix:// needs a socket path (unix:///run/redis.sock)"
        return ""
    if not parts.hostname:
        return "needs a host (redis://host:6379/0)"
    if port is not None and not 0 < port < 65536:
        return "the port must be in 1..65535"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"the database must be a number, got {db!r}"
    return ""
