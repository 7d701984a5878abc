"""The daemon's pools, one per device, and which pool each session uses.

Sizes are per device: ``--pool-bytes`` / ``--gpu-memory-fraction``,
``--host-bytes`` and ``--disk-bytes`` apply to each pool.  With one pool the
disk tier is ``--disk-dir`` itself (as before there were several); with
several, pool ``N`` keeps it in ``<disk-dir>/gpuN`` (``disk_dir_for``), the
directory the ``kvpoold@N`` unit uses, so a restart finds each device's blocks.

``DevicePools`` binds a session to one pool at attach, by the PCI bus id of
the client's GPU (``choose``): CUDA ordinals differ between processes with
different ``CUDA_VISIBLE_DEVICES``, the bus id does not.  Every later call
of the session goes to that pool, through the ``PoolSession`` made at
attach (``session_pool.py``; ``calls``).
"""

from __future__ import annotations

import logging
import os

from kvpoold.config import Config
from kvpool.ipc import DeviceMismatch
from kvpoold.transfer import open_private_dir

from .pools import DevicePool, normalize_bus_id
from .session_pool import PoolSession
from .tiers import resolve_disk_dir

log = logging.getLogger("kvpoold")


def disk_dir_for(config: Config, device: int, npools: int) -> str:
    """The disk tier's directory of the pool on ``device``: ``--disk-dir``, or ``<disk-dir>/gpuN`` with
    several pools."""
    base = resolve_disk_dir(config.disk_dir)
    if npools > 1 and base:
        return os.path.join(base, f"gpu{device}")
    return base


def check_disk_root(config: Config, npools: int) -> None:
    """With several pools ``--disk-dir`` holds their ``gpuN`` directories: it must be kvpoold's own too
    (``transfer.disk_files.open_private_dir``; ``DiskTierError`` if not), checked before anything is made in it."""
    base = resolve_disk_dir(config.disk_dir)
    if npools > 1 and base and config.disk_bytes:
        os.close(open_private_dir(base))


class DevicePools:
    """The daemon's pools, in ``--devices`` order, and the pool each session is bound to."""

    def __init__(self) -> None:
        self.pools: list[DevicePool] = []
        self._of: dict[int, PoolSession] = {}  # session id -> its calls on its pool

    def add(self, pool: DevicePool) -> DevicePool:
        if pool.bus_id and any(p.bus_id == pool.bus_id for p in self.pools):
            raise ValueError(f"GPU {pool.bus_id} is listed twice in --devices")
        self.pools.append(pool)
        return pool

    def __iter__(self):
        return iter(self.pools)

    def __len__(self) -> int:
        return len(self.pools)

    def describe(self) -> str:
        return ", ".join(p.name for p in self.pools)

    def choose(self, bus_id: str) -> DevicePool:
        """The pool of the client's GPU (its PCI bus id); ``""``: the only pool.

        A client on a GPU no pool is on, or one that names no GPU while the
        daemon serves several, gets ``DeviceMismatch`` (FAILED_PRECONDITION)
        naming the devices served.
        """
        bus = normalize_bus_id(bus_id)
        if len(self.pools) == 1 and (not bus or not self.pools[0].bus_id):
            return self.pools[0]  # one pool (or the CPU backend): a client without a GPU is no ambiguity
        if not bus:
            raise DeviceMismatch(
                f"this kvpoold serves several GPUs ({self.describe()}) and the client named none: "
                "run it on one of them (kvpool.connect(device=...), or torch.cuda.set_device before connecting)"
            )
        for p in self.pools:
            if p.bus_id == bus:
                return p
        raise DeviceMismatch(
            f"the client runs on GPU {bus}, which this kvpoold does not serve; it serves {self.describe()}: "
            "run the client on one of those GPUs, or attach to the daemon of its GPU"
        )

    def bind(self, calls: PoolSession) -> None:
        self._of[calls.session.id] = calls
        calls.pool.sessions += 1
        calls.pool.quotas.shares.bind(calls.session)

    def unbind(self, session_id: int) -> DevicePool | None:
        calls = self._of.pop(session_id, None)
        if calls is None:
            return None
        calls.pool.sessions -= 1
        calls.pool.quotas.shares.unbind(calls.session)
        return calls.pool

    def of(self, session) -> DevicePool:
        """The pool a session was bound to at attach."""
        return self._of[session.id].pool

    def calls(self, session) -> PoolSession:
        """The session's calls on its pool (bound at attach)."""
        return self._of[session.id]

    def close(self) -> None:
        """Close every pool (each releases its device memory even if another fails)."""
        while self.pools:
            pool = self.pools.pop()
            try:
                pool.close()
            except Exception:  # noqa: BLE001 - the other pools must still be released
                log.exception("%s: closing the pool failed", pool.name)
        self._of.clear()


__all__ = ["DevicePools", "check_disk_root", "disk_dir_for"]
