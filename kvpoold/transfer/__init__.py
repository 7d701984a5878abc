"""Block copies between tiers: the transfer engine and the host and disk stores.

``TransferEngine`` runs the core's planned moves (``MovePlan`` columns) on
real bytes (batched, asynchronous, with one completion per batch);
``HostStore`` holds tier 1 (pinned host memory on a GPU machine),
``DiskStore`` tier 2 (files with checksums and an index that survives
restarts).  Nothing here knows about gRPC.
"""

from .disk import DiskStore, DiskTierError, open_private_dir
from .engine import Arrivals, CpuCopier, TransferEngine
from .host import HostStore
from .meter import Meter, Meters

__all__ = ["Arrivals", "CpuCopier", "DiskStore", "DiskTierError", "HostStore", "Meter", "Meters", "TransferEngine",
           "open_private_dir"]
