"""Block copies between tiers: the transfer engine and the host and disk stores.

``TransferEngine`` runs the core's planned moves (``MovePlan`` columns) on
real bytes (batched, asynchronous, with one completion per batch);
``HostStore`` holds tier 1 (pinned host memory on a GPU machine),
``DiskStore`` tier 2 (files with checksums and an index that survives
restarts).  Nothing here knows about gRPC.

Modules: ``engine`` (``TransferEngine``) composes ``completions`` (the queue
of copy completions), ``arrivals`` (a batch of device writes), the copiers
(``cpu_copier``, ``cuda``) and the stores: ``host``, ``disk`` (with
``disk_files``: the directory and data files, ``disk_index``: the index log)
and ``remote`` (with ``remote_settings`` and ``remote_values``: keys, headers
and checks).
"""

from .arrivals import Arrivals
from .cpu_copier import CpuCopier
from .disk import DiskStore
from .disk_files import DiskTierError, open_private_dir
from .engine import TransferEngine
from .host import HostStore
from .meter import Meter, Meters

__all__ = ["Arrivals", "CpuCopier", "DiskStore", "DiskTierError", "HostStore", "Meter", "Meters", "TransferEngine",
           "open_private_dir"]
