"""The documentation names every option: each configuration key in docs/configuration.md's table, each
kvpoolctl command in the README's command table, and every page the README links to exists."""

from __future__ import annotations

import re
from pathlib import Path

from kvpoold.config import KEYS
from kvpoold.ctl import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_configuration_key_has_a_row():
    table = (ROOT / "docs" / "configuration.md").read_text()
    documented = set()
    for row in table.splitlines():
        if row.startswith("| ") and not row.startswith("| key"):
            documented.update(k.strip() for k in row.split("|")[1].split(","))
    assert sorted(set(KEYS) - documented) == []


def test_every_kvpoolctl_command_is_in_the_readme():
    commands = list(cli.commands)
    assert len(commands) > 5
    missing = [c for c in commands if f"| `{c}" not in README]
    assert missing == []


def test_the_readme_links_only_to_pages_that_exist():
    links = re.findall(r"\]\(((?:docs|systemd|benchmarks)/[^)#]+)", README) + ["CONTRIBUTING.md"]
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert len(links) > 10
