"""``kvpoolctl``: look at and steer a running kvpoold.

Uses only the client library (``kvpool.Connection``), never daemon internals.

Exit codes: 0 success; 1 the daemon answered with an error; 2 bad usage;
3 the daemon is not reachable; 4 ``check`` found a broken invariant.
"""

from __future__ import annotations

import json
import sys
import time

import click
from rich.console import Console
from rich.table import Table

from kvpool import Connection, KvpoolError, Unavailable

EXIT_ERROR, EXIT_UNREACHABLE, EXIT_CHECK_FAILED = 1, 3, 4


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fail(message: str, code: int) -> None:
    click.echo(f"kvpoolctl: {message}", err=True)
    sys.exit(code)


class _Ctx:
    def __init__(self, socket: str | None, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout

    def connect(self) -> Connection:
        return Connection(self.socket, timeout=self.timeout)

    def run(self, fn):
        """Call ``fn(connection)`` and turn daemon errors into one line and an exit code."""
        conn = self.connect()
        try:
            return fn(conn)
        except Unavailable as exc:
            _fail(str(exc), EXIT_UNREACHABLE)
        except KvpoolError as exc:
            _fail(f"{exc.code}: {exc}", EXIT_ERROR)
        finally:
            conn.close()


@click.group(epilog="Exit codes: 0 ok, 1 daemon error, 2 usage, 3 daemon not reachable, 4 check failed.")
@click.option("--socket", envvar="KVPOOL_SOCKET", help="kvpoold's socket (default /run/kvpoold/kvpoold.sock; env KVPOOL_SOCKET).")
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for the daemon.")
@click.version_option(package_name="kvpool", prog_name="kvpoolctl")
@click.pass_context
def cli(ctx: click.Context, socket: str | None, timeout: float) -> None:
    """Inspect and operate a running kvpoold."""
    ctx.obj = _Ctx(socket, timeout)


def stats_table(st) -> Table:
    """One column per layout class (device tier) and per lower tier; one row per figure."""
    table = Table(
        title=f"kvpoold {st.version} · {st.backend} backend · pool {human_bytes(st.pool_bytes)} · "
              f"up {st.uptime_seconds:.0f}s",
        caption=f"{st.clients} clients · {st.sequences} sequences · {st.rpcs} calls · "
                f"{human_bytes(st.free_bytes)} not assigned to a layout",
    )
    table.add_column("", style="bold")
    for c in st.classes:
        table.add_column(f"class {c.class_id} · device", justify="right")
    lower = [t for t in st.tiers if t.capacity_bytes]
    for t in lower:
        table.add_column(f"{t.tier} tier", justify="right")
    blank = [""] * len(lower)

    def row(name, per_class, per_tier=None):
        table.add_row(name, *[per_class(c) for c in st.classes], *(per_tier and [per_tier(t) for t in lower] or blank))

    row("layout", lambda c: c.geometry)
    row("models", lambda c: ", ".join(c.models))
    row("block size", lambda c: human_bytes(c.block_bytes))
    row("total blocks", lambda c: f"{c.total_blocks} ({human_bytes(c.total_blocks * c.block_bytes)})",
        lambda t: human_bytes(t.capacity_bytes))
    row("used", lambda c: f"{c.used_blocks} ({human_bytes(c.used_blocks * c.block_bytes)})",
        lambda t: human_bytes(t.used_bytes))
    row("  of which reserved", lambda c: str(c.reserved_blocks))
    row("cached", lambda c: f"{c.cached_blocks} ({human_bytes(c.cached_blocks * c.block_bytes)})",
        lambda t: str(t.blocks))
    row("free", lambda c: f"{c.free_blocks} ({human_bytes(c.free_blocks * c.block_bytes)})",
        lambda t: human_bytes(t.capacity_bytes - t.used_bytes))
    row("prefix queries", lambda c: str(c.prefix_queries))
    row("prefix hits", lambda c: str(c.prefix_hits))
    row("hit rate (tokens)", lambda c: f"{100 * c.hit_rate:.1f}% of {c.prefix_query_tokens}")
    row("copy-on-write copies", lambda c: str(c.cow_copies))
    row("evictions", lambda c: str(c.evictions))
    return table


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh in place every SECONDS.")
@click.pass_obj
def stats(obj: _Ctx, as_json: bool, watch: float | None) -> None:
    """Pool usage per layout class and tier, clients, prefix-cache hits.

    \b
    Examples:
      kvpoolctl stats
      kvpoolctl --socket /tmp/kvpool.sock stats --json
      kvpoolctl stats --watch 1
    """
    if watch is None:
        st = obj.run(lambda c: c.stats())
        if as_json:
            click.echo(json.dumps(st.to_dict(), indent=2))
        else:
            Console().print(stats_table(st))
        return
    from rich.live import Live

    with Live(console=Console(), auto_refresh=False) as live:
        while True:
            st = obj.run(lambda c: c.stats())
            live.update(stats_table(st), refresh=True)
            time.sleep(watch)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def clients(obj: _Ctx, as_json: bool) -> None:
    """Attached model processes and what they hold.

    \b
    Example:
      kvpoolctl clients
    """
    rows = obj.run(lambda c: c.clients())
    if as_json:
        click.echo(json.dumps([vars(r) for r in rows], indent=2))
        return
    table = Table(title="clients")
    for col in ("session", "name", "pid", "model", "class", "sequences", "reserved", "connected", "attached"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r.session_id), r.name, str(r.pid), r.model_id, str(r.class_id), str(r.sequences),
                      str(r.reserved_blocks), "yes" if r.connected else "no", f"{r.attached_seconds:.0f}s")
    Console().print(table)


@cli.command()
@click.argument("session_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def sequences(obj: _Ctx, session_id: int, as_json: bool) -> None:
    """The sequences of one session (see `kvpoolctl clients` for ids).

    \b
    Example:
      kvpoolctl sequences 3
    """
    rows = obj.run(lambda c: c.sequences_of(session_id))
    if as_json:
        click.echo(json.dumps([vars(r) for r in rows], indent=2))
        return
    table = Table(title=f"sequences of session {session_id}")
    for col in ("sequence", "tokens", "cached at start", "blocks"):
        table.add_column(col)
    for r in rows:
        shown = " ".join(map(str, r.block_table[:12])) + (" ..." if len(r.block_table) > 12 else "")
        table.add_row(str(r.seq_id), str(r.num_tokens), str(r.num_cached_tokens), shown)
    Console().print(table)


@cli.command()
@click.option("--class", "class_id", type=int, default=None, help="Only this layout class.")
@click.option("--max-blocks", type=click.IntRange(min=1), default=None, help="At most this many blocks.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def evict(obj: _Ctx, class_id: int | None, max_blocks: int | None, as_json: bool) -> None:
    """Drop cached (unused) blocks from the prefix cache, oldest first.

    \b
    Examples:
      kvpoolctl evict                  # every cached block
      kvpoolctl evict --class 0 --max-blocks 100
    """
    n = obj.run(lambda c: c.evict(class_id, max_blocks))
    click.echo(json.dumps({"evicted": n}) if as_json else f"evicted {n} cached blocks")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def check(obj: _Ctx, as_json: bool) -> None:
    """Verify the daemon's invariants (every block accounted for once, ref counts, sessions).

    \b
    Example:
      kvpoolctl check && echo healthy
    """
    ok, detail = obj.run(lambda c: c.check())
    click.echo(json.dumps({"ok": ok, "detail": detail}) if as_json else ("ok: " if ok else "FAILED: ") + detail)
    if not ok:
        sys.exit(EXIT_CHECK_FAILED)


def main() -> None:
    cli(prog_name="kvpoolctl")


if __name__ == "__main__":
    main()
