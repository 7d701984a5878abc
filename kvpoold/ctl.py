"""``kvpoolctl``: look at and steer a running kvpoold.

Uses only the client library (``kvpool.Connection``), never daemon internals.
Read-only commands (stats, clients, config, check) go to the normal socket;
admin commands (sequences, evict, drain) go to the admin socket, which is
mode 0600 by default: run them as root or as the daemon's user.

Sockets: ``--socket`` > ``$KVPOOL_SOCKET`` > ``socket`` in the daemon's config
file (``--config``, default /etc/kvpoold/kvpoold.toml when readable) >
/run/kvpoold/kvpoold.sock.  The admin socket: ``--admin-socket`` >
``$KVPOOL_ADMIN_SOCKET`` > the config file's ``admin_socket`` > beside the
socket (``kvpoold.sock`` -> ``kvpoold-admin.sock``).

Exit codes: 0 success; 1 the daemon answered with an error; 2 bad usage;
3 the daemon is not running or not reachable; 4 ``check`` found a broken
invariant; 5 permission denied (socket file mode, or an admin call refused).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import click
from rich.console import Console
from rich.table import Table

from kvpool import Connection, KvpoolError, PermissionDenied, Unavailable
from kvpool.protocol.stats import PoolStats
from kvpoold.config import DEFAULT_CONFIG, DEFAULT_SOCKET, ConfigError, admin_socket_for, load_config, parse_bytes

EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_CHECK_FAILED, EXIT_DENIED = 1, 2, 3, 4, 5

EXIT_CODES = (
    "Exit codes: 0 ok, 1 the daemon answered with an error, 2 bad usage, 3 kvpoold not running or not "
    "reachable, 4 check found a broken invariant, 5 permission denied (socket mode, or an admin call on "
    "the normal socket)."
)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# Bounds of the wire fields the options travel in (protos/kvpool.proto): a
# larger value would pass click and then fail serialization with a traceback.
UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


class Seconds(click.ParamType):
    """A finite duration in seconds: nan passes every range check and inf overflows timers."""

    name = "seconds"

    def __init__(self, min: float = 0.0, min_open: bool = False, max: float = 365 * 86400.0) -> None:
        self.min, self.min_open, self.max = min, min_open, max

    def convert(self, value, param, ctx):
        try:
            out = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        if out < self.min or (self.min_open and out == self.min) or out > self.max:
            low = f"more than {self.min:g}" if self.min_open else f"at least {self.min:g}"
            self.fail(f"{value!r} must be {low} and at most {self.max:g} seconds", param, ctx)
        return out


class Size(click.ParamType):
    """A size in bytes: ``64GiB``, ``512MiB``, ``1.5G`` or a number of bytes, within the wire's uint64."""

    name = "size"

    def convert(self, value, param, ctx):
        try:
            out = parse_bytes(value)
        except ValueError as exc:
            self.fail(f"{value!r}: {exc}", param, ctx)
        if not 0 < out <= UINT64_MAX:
            self.fail(f"{value!r} must be more than 0 and at most {UINT64_MAX} bytes", param, ctx)
        return out


def _fail(message: str, code: int) -> None:
    click.echo(f"kvpoolctl: {message}", err=True)
    sys.exit(code)


def _echo_json(value) -> None:
    click.echo(json.dumps(value, indent=2))


class _Ctx:
    def __init__(self, socket: str | None, admin_socket: str | None, config: str | None, timeout: float) -> None:
        self.timeout = timeout
        cfg = None
        if config is not None or os.access(DEFAULT_CONFIG, os.R_OK):
            try:
                cfg = load_config(path=config or DEFAULT_CONFIG, env={}, flags={})
            except ConfigError as exc:
                if config is not None:
                    _fail(f"cannot read the daemon's configuration: {exc}", EXIT_USAGE)
        self.socket = socket or (cfg.socket if cfg else DEFAULT_SOCKET)
        self.admin_socket = admin_socket or admin_socket_for(self.socket, cfg.admin_socket if cfg else "auto")

    def run(self, fn, admin: bool = False):
        """Call ``fn(connection)`` and turn daemon errors into one line and an exit code."""
        path = self.socket
        if admin:
            if not self.admin_socket:
                _fail("this command needs the admin socket, and none is configured (admin_socket)", EXIT_USAGE)
            path = self.admin_socket
        if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            who = "run it as root or as the daemon's user" if admin else "join the socket's group (socket_group)"
            _fail(f"permission denied on {path}: {who}", EXIT_DENIED)
        conn = Connection(path, timeout=self.timeout)
        try:
            return fn(conn)
        except Unavailable as exc:
            _fail(_unreachable(path, exc, admin), EXIT_UNREACHABLE)
        except PermissionDenied as exc:
            _fail(f"{exc.code}: {exc}", EXIT_DENIED)
        except KvpoolError as exc:
            _fail(f"{exc.code}: {exc}", EXIT_ERROR)
        finally:
            conn.close()


def _unreachable(path: str, exc: Exception, admin: bool = False) -> str:
    if admin and not os.path.exists(path):
        return (f"kvpoold is not running, or has no admin socket: nothing at {path} "
                "(see `kvpoolctl config`, or pass --admin-socket)")
    if not os.path.exists(path):
        return (f"kvpoold is not running: no socket at {path} "
                "(start it with `systemctl start kvpoold`, or pass --socket)")
    if "refused" in str(exc).lower():
        return f"kvpoold is not running: nothing listens on {path} (a stale socket?)"
    return str(exc)


@click.group(epilog=EXIT_CODES)
@click.option("--socket", envvar="KVPOOL_SOCKET", metavar="PATH",
              help=f"kvpoold's socket (default: the config file's, else {DEFAULT_SOCKET}; env KVPOOL_SOCKET).")
@click.option("--admin-socket", envvar="KVPOOL_ADMIN_SOCKET", metavar="PATH",
              help="kvpoold's admin socket for sequences/evict/drain (default: the config file's, else "
                   "<socket>-admin.sock; env KVPOOL_ADMIN_SOCKET).")
@click.option("--config", envvar="KVPOOL_CONFIG", metavar="FILE",
              help=f"read the socket paths from this kvpoold config (default {DEFAULT_CONFIG} if readable).")
@click.option("--timeout", type=Seconds(min=0, min_open=True), default=10.0, show_default=True, help="Seconds to wait for the daemon.")
@click.version_option(package_name="kvpool", prog_name="kvpoolctl")
@click.pass_context
def cli(ctx: click.Context, socket: str | None, admin_socket: str | None, config: str | None, timeout: float) -> None:
    """Inspect and operate a running kvpoold.

    \b
    Examples:
      kvpoolctl stats --watch 1
      kvpoolctl --socket /tmp/kvpool.sock clients --json
      sudo kvpoolctl drain --wait
    """
    ctx.obj = _Ctx(socket, admin_socket, config, timeout)


def devices_table(st: PoolStats) -> Table:
    """One row per pool of a daemon serving several GPUs (``--devices 0,1``)."""
    table = Table(title="pools (one per GPU)")
    for col in ("device", "PCI bus id", "pool", "not assigned", "used", "cached", "clients", "sequences"):
        table.add_column(col, justify="left" if col in ("device", "PCI bus id") else "right")
    for d in st.devices:
        used = sum(c.used_blocks * c.block_bytes for c in d.classes)
        cached = sum(c.cached_blocks * c.block_bytes for c in d.classes)
        table.add_row(d.name, d.bus_id or "-", human_bytes(d.pool_bytes), human_bytes(d.free_bytes),
                      human_bytes(used), human_bytes(cached), str(d.clients), str(d.sequences))
    return table


def remote_table(r) -> Table:
    """The remote tier (tier 3): its state, hits and misses, traffic and faults."""
    table = Table(title=f"remote tier · {r.url} · {r.state.upper()}",
                  caption=f"last error: {r.last_error}" if r.last_error else None)
    for col in ("lookups", "hit / miss (blocks)", "mean latency", "read", "written (blocks)", "write queue",
                "timeouts / failures / skipped", "corrupt / forged", "dropped writes"):
        table.add_column(col, justify="right")
    table.add_row(str(r.lookups), f"{r.hit_blocks} / {r.miss_blocks}", f"{r.fetch_ms:.2f} ms",
                  human_bytes(r.bytes_read), f"{human_bytes(r.bytes_written)} ({r.blocks_written})",
                  str(r.write_queue_blocks), f"{r.timeouts} / {r.failures} / {r.skipped_lookups}",
                  f"{r.corrupt_blocks} / {r.forged_blocks}", str(r.write_dropped))
    return table


def stats_view(st: PoolStats):
    """``stats_table``; with several pools, the per-pool rows above it; the remote tier below it."""
    parts = [stats_table(st)]
    if len(st.devices) > 1:
        parts.insert(0, devices_table(st))
    parts += [remote_table(r) for r in st.remote]
    if len(parts) > 1:
        from rich.console import Group

        return Group(*parts)
    return parts[0]


def _memory_caption(d) -> str:
    """vmm: what the GPU holds for the pool now (created chunks), still draining, and given back."""
    if d.memory != "vmm":
        return ""
    return (f"\n{d.name}: elastic (vmm), {human_bytes(d.physical_bytes)} held of at most {human_bytes(d.pool_bytes)}"
            f" · {human_bytes(d.draining_bytes)} draining · {human_bytes(d.freed_bytes)} given back to the GPU"
            f" ({1e3 * d.free_seconds:.1f} ms)")


def stats_table(st: PoolStats) -> Table:
    """One column per layout class (device tier) and per lower tier; one row per figure.

    With several pools (one per GPU) each column is one pool's class or tier, named by its GPU.
    """
    devices = st.devices
    several = len(devices) > 1
    where = ""
    if len(devices) == 1 and devices[0].device >= 0:
        where = f" on {devices[0].name}" + (f" ({devices[0].bus_id})" if devices[0].bus_id else "")
    elif several:
        where = f" on {len(devices)} GPUs"
    table = Table(
        title=f"kvpoold {st.version} · {st.backend} backend · pool {human_bytes(st.pool_bytes)}{where} · "
              f"up {st.uptime_seconds:.0f}s" + (" · DRAINING" if st.draining else ""),
        caption=f"{st.clients} clients · {st.sequences} sequences · {st.rpcs} calls · "
                f"{human_bytes(st.free_bytes)} not assigned to a layout" + "".join(_memory_caption(d) for d in devices),
    )
    table.add_column("", style="bold")
    if several:
        classes = [(f"{d.name} · class {c.class_id}", c) for d in devices for c in d.classes]
        lower = [(f"{d.name} · {t.tier} tier", t) for d in devices for t in d.tiers if t.capacity_bytes]
    else:
        classes = [(f"class {c.class_id} · device", c) for c in st.classes]
        lower = [(f"{t.tier} tier", t) for t in st.tiers if t.capacity_bytes]
    for name, _ in classes + lower:
        table.add_column(name, justify="right")
    blank = [""] * len(lower)

    def row(name, per_class, per_tier=None):
        table.add_row(name, *[per_class(c) for _, c in classes],
                      *(per_tier and [per_tier(t) for _, t in lower] or blank))

    row("layout", lambda c: c.geometry)
    if any(c.tenant for _, c in classes):
        row("tenant", lambda c: c.tenant)
    row("models", lambda c: ", ".join(c.models))
    row("block size", lambda c: human_bytes(c.block_bytes))
    row("memory mapped / released", lambda c: f"{human_bytes(c.mapped_bytes)} / {human_bytes(c.released_bytes)}")
    row("memory taken (commit / release time)", lambda c: f"{human_bytes(c.taken_bytes)} "
        f"({1e3 * c.commit_seconds:.1f} / {1e3 * c.release_seconds:.1f} ms)")
    row("virtual range", lambda c: human_bytes(c.reserved_bytes))
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
    # tiers: blocks moved, and the rate of the copies while they ran
    row("promoted (blocks)", lambda c: str(c.promoted_blocks), lambda t: str(t.blocks_out))
    row("demoted (blocks)", lambda c: str(c.demoted_blocks), lambda t: str(t.blocks_in))
    row("swapped out / in (blocks)", lambda c: f"{c.swapped_out_blocks} / {c.swapped_in_blocks}",
        lambda t: f"{human_bytes(t.pinned_bytes)} held")
    row("swapped-out sequences", lambda c: str(c.swapped_sequences))
    row("written to tier", lambda c: "", lambda t: f"{human_bytes(t.bytes_written)} · {t.write_gbps:.2f} GB/s")
    row("read from tier", lambda c: "", lambda t: f"{human_bytes(t.bytes_read)} · {t.read_gbps:.2f} GB/s")
    row("dropped / corrupt (blocks)", lambda c: f"{c.lost_blocks} lost",
        lambda t: f"{t.dropped_blocks} / {t.corrupt_blocks}")
    row("failed writes / reads (blocks)", lambda c: "",  # I/O errors of the tier
        lambda t: f"{t.failed_writes} / {t.failed_reads}")
    return table


@cli.command(epilog=EXIT_CODES)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table (with --watch: one line each time).")
@click.option("--watch", type=Seconds(min=0.05), default=None, metavar="SECONDS",
              help="Refresh in place every SECONDS until Ctrl-C.")
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
            _echo_json(st.to_dict())
        else:
            Console().print(stats_view(st))
        return
    try:
        if as_json:
            while True:
                click.echo(json.dumps(obj.run(lambda c: c.stats()).to_dict()))
                time.sleep(watch)
        from rich.live import Live

        with Live(console=Console(), auto_refresh=False) as live:
            while True:
                live.update(stats_view(obj.run(lambda c: c.stats())), refresh=True)
                time.sleep(watch)
    except KeyboardInterrupt:
        pass


@cli.command(epilog=EXIT_CODES)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they happen (until Ctrl-C).")
@click.option("--recent", type=click.IntRange(min=0, max=UINT32_MAX), default=100, show_default=True,
              help="Print this many recent events first.")
@click.option("--for", "seconds", type=Seconds(min=0, min_open=True), default=None, metavar="SECONDS",
              help="With --follow: stop after SECONDS.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def events(obj: _Ctx, follow: bool, recent: int, seconds: float | None, as_json: bool) -> None:
    """KV events: blocks stored in, removed from and moved between tiers (for routers). Admin socket.

    \b
    Examples:
      sudo kvpoolctl events --recent 20
      sudo kvpoolctl events --follow --json | my-router
    """

    def show(conn) -> None:
        for ev in conn.events(follow=follow, recent=recent, timeout=seconds):
            if as_json:
                click.echo(json.dumps(ev))
            elif ev["kind"] == "gap":
                click.echo(f"-- {ev['dropped']} events missed (this reader fell behind) --")
            else:
                where = f"{ev['from_tier']} -> {ev['tier']}" if ev["from_tier"] else ev["tier"]
                hashes = ev["block_hashes"]
                click.echo(f"{ev['seq']:>8} {ev['kind']:<8} {where:<15} {','.join(ev['model_ids']) or '-'} "
                           f"{len(hashes)} blocks {hashes[0][:12]}{'...' if len(hashes) > 1 else ''}")

    try:
        obj.run(show, admin=True)
    except KeyboardInterrupt:
        pass


@cli.command(epilog=EXIT_CODES)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def clients(obj: _Ctx, as_json: bool) -> None:
    """Attached model processes and what they hold.

    \b
    Examples:
      kvpoolctl clients
      kvpoolctl clients --json | jq '.[].pid'
    """
    rows = obj.run(lambda c: c.clients())
    if as_json:
        _echo_json([vars(r) for r in rows])
        return
    table = Table(title="clients")
    gpus = any(r.device.startswith("cuda") for r in rows)  # the pool (GPU) of each session
    for col in ("session", "name", "pid", "model", *(("device",) if gpus else ()), "class", "sequences",
                "reserved", "connected", "attached"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r.session_id), r.name, str(r.pid), r.model_id, *((r.device,) if gpus else ()),
                      str(r.class_id), str(r.sequences), str(r.reserved_blocks), "yes" if r.connected else "no",
                      f"{r.attached_seconds:.0f}s")
    Console().print(table)


@cli.command(epilog=EXIT_CODES)
@click.argument("session_id", type=click.IntRange(min=1, max=UINT64_MAX))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def sequences(obj: _Ctx, session_id: int, as_json: bool) -> None:
    """The sequences of one session (see `kvpoolctl clients` for ids). Admin socket.

    \b
    Examples:
      sudo kvpoolctl sequences 3
      sudo kvpoolctl sequences 3 --json
    """
    rows = obj.run(lambda c: c.sequences_of(session_id), admin=True)
    if as_json:
        _echo_json([vars(r) for r in rows])
        return
    table = Table(title=f"sequences of session {session_id}")
    for col in ("sequence", "tokens", "cached at start", "blocks"):
        table.add_column(col)
    for r in rows:
        shown = " ".join(map(str, r.block_table[:12])) + (" ..." if len(r.block_table) > 12 else "")
        table.add_row(str(r.seq_id), str(r.num_tokens), str(r.num_cached_tokens), shown)
    Console().print(table)


@cli.command(epilog=EXIT_CODES)
@click.option("--class", "class_id", type=click.IntRange(min=0, max=INT32_MAX), default=None,
              help="Only this layout class.")
@click.option("--max-blocks", type=click.IntRange(min=1, max=UINT64_MAX), default=None,
              help="At most this many blocks.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def evict(obj: _Ctx, class_id: int | None, max_blocks: int | None, as_json: bool) -> None:
    """Drop cached (unused) blocks from the prefix cache, oldest first. Admin socket.

    \b
    Examples:
      sudo kvpoolctl evict                  # every cached block
      sudo kvpoolctl evict --class 0 --max-blocks 100 --json
    """
    n = obj.run(lambda c: c.evict(class_id, max_blocks), admin=True)
    click.echo(json.dumps({"evicted": n}) if as_json else f"evicted {n} cached blocks")


@cli.command(epilog=EXIT_CODES)
@click.option("--pool-bytes", type=Size(), required=True, help="The new ceiling of each pool resized, e.g. 40GiB.")
@click.option("--device", type=click.IntRange(min=0, max=INT32_MAX), default=None,
              help="Only the pool of this GPU (the daemon's CUDA ordinal); default: every pool.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def resize(obj: _Ctx, pool_bytes: int, device: int | None, as_json: bool) -> None:
    """Move the pool's ceiling now. Admin socket.

    Growing takes effect at once (up to the GPU's memory with CUDA virtual
    memory; up to the size at start otherwise).  Shrinking gives memory back
    at once: unassigned memory first, then empty slabs, then slabs holding
    only cached blocks (evicted to the lower tiers); never a held block.  A
    shrink that held blocks stop says how far it got and exits 1.

    \b
    Examples:
      sudo kvpoolctl resize --pool-bytes 40GiB
      sudo kvpoolctl resize --pool-bytes 8GiB --device 1 --json
    """
    pools = obj.run(lambda c: c.resize(pool_bytes, device), admin=True)
    if as_json:
        _echo_json(pools)
    else:
        for p in pools:
            where = "cpu" if p["device"] < 0 else f"cuda:{p['device']}"
            how = "" if p["met"] else f" (asked {human_bytes(p['target_bytes'])}: held blocks stop the shrink there)"
            click.echo(f"{where}: pool {human_bytes(p['pool_bytes'])}{how}; {human_bytes(p['freed_bytes'])} given "
                       f"back, {p['evicted_blocks']} cached blocks evicted; at most {human_bytes(p['max_pool_bytes'])}")
    if not all(p["met"] for p in pools):
        sys.exit(EXIT_ERROR)


@cli.command(epilog=EXIT_CODES)
@click.option("--off", "resume", is_flag=True, help="End the drain: take new attaches and sequences again.")
@click.option("--wait", is_flag=True, help="Then wait until no sequence is left (exit 1 if --wait-timeout passes).")
@click.option("--wait-timeout", type=Seconds(min=0), default=None, metavar="SECONDS",
              help="With --wait: give up after SECONDS (default: wait forever).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def drain(obj: _Ctx, resume: bool, wait: bool, wait_timeout: float | None, as_json: bool) -> None:
    """Stop taking new attaches and new sequences; running sequences go on. Admin socket.

    Use before a restart: drain, wait for the sequences to finish, then
    `systemctl restart kvpoold`.

    \b
    Examples:
      sudo kvpoolctl drain
      sudo kvpoolctl drain --wait --wait-timeout 600 && sudo systemctl restart kvpoold
      sudo kvpoolctl drain --off
    """
    r = obj.run(lambda c: c.drain(resume=resume), admin=True)
    deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
    while wait and not resume and r["sequences"]:
        if deadline is not None and time.monotonic() >= deadline:
            if as_json:
                click.echo(json.dumps({**r, "finished": False}))
            _fail(f"still {r['sequences']} sequences after {wait_timeout:g}s", EXIT_ERROR)
        time.sleep(0.2)
        r = obj.run(lambda c: c.drain(resume=False), admin=True)
    if as_json:
        click.echo(json.dumps({**r, "finished": r["sequences"] == 0}))
    elif r["draining"]:
        click.echo(f"draining: {r['sessions']} sessions, {r['sequences']} sequences left")
    else:
        click.echo(f"not draining: taking new attaches and sequences ({r['sessions']} sessions)")


@cli.command(epilog=EXIT_CODES)
@click.option("--yes", is_flag=True, help="Do it: without --yes nothing happens.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def reset(obj: _Ctx, yes: bool, as_json: bool) -> None:
    """Drop every session and every cached block: an empty pool. Admin socket.

    Attached clients lose their sequences and must attach again (their next
    call answers UNAUTHENTICATED).

    \b
    Example:
      sudo kvpoolctl reset --yes
    """
    if not yes:
        _fail("reset drops every session and cached block; add --yes to do it", 2)
    r = obj.run(lambda c: c.reset(), admin=True)
    if as_json:
        click.echo(json.dumps(r))
    else:
        click.echo(f"reset: dropped {r['sessions_dropped']} sessions ({r['blocks_released']} blocks), "
                   f"evicted {r['cached_evicted']} cached blocks")


@cli.command(epilog=EXIT_CODES)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def config(obj: _Ctx, as_json: bool) -> None:
    """The daemon's running configuration (after its file, environment, flags and reloads).

    Settings marked live change with `systemctl reload kvpoold` (SIGHUP); the
    others need a restart.

    \b
    Examples:
      kvpoolctl config
      kvpoolctl config --json | jq .config.max_blocks_per_session
    """
    r = obj.run(lambda c: c.config())
    if as_json:
        _echo_json(r)
        return
    table = Table(title="kvpoold configuration", caption=f"admin socket: {r['admin_socket'] or 'none'}")
    for col in ("setting", "value", "reload"):
        table.add_column(col)
    for key, value in r["config"].items():
        table.add_row(key, json.dumps(value), "live" if key in r["live_keys"] else "restart")
    Console().print(table)


@cli.command(epilog=EXIT_CODES)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
def check(obj: _Ctx, as_json: bool) -> None:
    """Verify the daemon's invariants in every pool (every block accounted for once, ref counts, sessions).

    \b
    Examples:
      kvpoolctl check && echo healthy
      kvpoolctl check --json
    """
    ok, detail = obj.run(lambda c: c.check())
    click.echo(json.dumps({"ok": ok, "detail": detail}) if as_json else ("ok: " if ok else "FAILED: ") + detail)
    if not ok:
        sys.exit(EXIT_CHECK_FAILED)


def main() -> None:
    cli(prog_name="kvpoolctl")


if __name__ == "__main__":
    main()
