"""Building the configuration from defaults < TOML file < KVPOOL_* environment < flags, and showing it."""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields, replace
from typing import Any, Mapping

from .options import DEFAULT_CONFIG, ENV_PREFIX, KEYS, PARSERS, Config, ConfigError
from .remote_tier import redacted
from .validate import validate


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults < file < environment < flags.

    ``path`` None means the default file if it exists; a path that was asked
    for explicitly must exist.  ``flags`` holds only the flags actually given.
    """
    env = os.environ if env is None else env
    flags = flags or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    explicit = path is not None or "config" in flags or f"{ENV_PREFIX}CONFIG" in env
    path = flags.get("config") or path or env.get(f"{ENV_PREFIX}CONFIG") or DEFAULT_CONFIG
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        table = doc.get("kvpoold", doc)
        for key, value in table.items():
            if key not in PARSERS:
                raise ConfigError(f"config file {path}: unknown key {key!r} (known: {', '.join(KEYS)})")
            values[key], sources[key] = value, f"from {path}"
    elif explicit:
        raise ConfigError(f"config file {path} does not exist")

    for key in KEYS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            values[key], sources[key] = env[name], f"from ${name}"
    for key, value in flags.items():
        if key == "config" or value is None:
            continue
        if key not in PARSERS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key], sources[key] = value, f"from --{key.replace('_', '-')}"

    parsed = {}
    for key, value in values.items():
        try:
            parsed[key] = PARSERS[key](value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key} = {value!r} ({sources[key]}): {exc}") from None
    cfg = replace(Config(), **parsed)
    validate(cfg, sources)
    return cfg


def config_as_dict(cfg: Config) -> dict[str, Any]:
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else (oct(v)[2:] if f.name.endswith("socket_mode") else v)
    out["remote_url"] = redacted(cfg.remote_url)  # the config is shown to every client (GetConfig)
    return out


def changed_keys(old: Config, new: Config) -> list[str]:
    """The settings whose value differs between two configurations."""
    return [f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)]
