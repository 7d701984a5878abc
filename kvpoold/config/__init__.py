"""kvpoold's configuration: defaults < TOML file < KVPOOL_* environment < flags.

One precedence rule, applied key by key.  Every value is validated at start;
a bad one raises ``ConfigError`` naming the key, the value and where it came
from, so the daemon can print one clear line and exit.

Modules, top to bottom; each imports only modules below it:

* ``load``: ``load_config`` (file, environment, flags, key by key), ``config_as_dict``, ``changed_keys``.
* ``validate``: the checks every value passes at start.
* ``remote_tier``: the remote tier's URL (``check_url``, ``redact``), key file and TLS files.
* ``limits``: the bounds values must respect end to end and the gRPC message size they need.
* ``options``: ``Config`` (every key and its default), each key's parser, ``LIVE_KEYS``.
* ``values``: parsers of values as written (``parse_bytes``: ``2GiB`` -> bytes, ...).

A new key: its field on ``Config`` and parser in ``options``, its check in ``validate``.
"""

from .limits import (
    EXTRA_KEY_FACTOR, MAX_BYTES, MAX_COUNT, MAX_MESSAGE_BYTES, MAX_SECONDS, MAX_TOKENS_PER_CALL, PER_USER_CAPS,
    needed_message_bytes, receive_limit,
)
from .load import changed_keys, config_as_dict, load_config
from .options import DEFAULT_CONFIG, DEFAULT_SOCKET, ENV_PREFIX, KEYS, LIVE_KEYS, Config, ConfigError, admin_socket_for
from .remote_tier import check_url, read_key_file, redact
from .values import parse_bytes

__all__ = [
    "DEFAULT_CONFIG", "DEFAULT_SOCKET", "ENV_PREFIX", "EXTRA_KEY_FACTOR", "KEYS", "LIVE_KEYS", "MAX_BYTES", "MAX_COUNT",
    "MAX_MESSAGE_BYTES", "MAX_SECONDS", "MAX_TOKENS_PER_CALL", "PER_USER_CAPS", "Config", "ConfigError",
    "admin_socket_for", "changed_keys", "check_url", "config_as_dict", "load_config", "needed_message_bytes",
    "parse_bytes", "read_key_file", "receive_limit", "redact",
]
