"""A pool's lookups in the remote tier (tier 3, a Redis server shared by every pool and daemon).

A create or a lookup whose prompt goes past the blocks cached on the local
tiers first asks the remote tier for the rest of the chain (``chains``, then
``fetch`` on a worker thread, within ``--remote-timeout``).  The payloads a
fetch brought are *staged* for the call that runs next: the transfer engine
copies them into the device blocks the core promotes from tier 3.  Without a
remote tier every lookup answers "nothing to ask".
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager, nullcontext

from kvpoold.core import KVCacheManager
from kvpoold.transfer.remote import RemoteLink


class RemoteLookups:
    """One pool's view of the remote tier: which blocks to ask for, the asking, the staging."""

    def __init__(self, manager: KVCacheManager, link: RemoteLink | None) -> None:
        """``link``: the pool's link to the daemon's store (its transfer engine writes through it too)."""
        self.manager = manager
        self.link = link

    def bind(self, class_id: int, layout: dict) -> None:
        """Class ``class_id`` has this layout (``tiers.layout_dict``): its namespace in the store."""
        if self.link is not None:
            self.link.bind(class_id, layout)

    def chains(self, class_id: int, model_id: str, prompts, owner: int) -> list[list[bytes]] | None:
        """Per prompt, the block hashes past its prefix cached on the local tiers: what to ask the remote
        tier for; None when there is nothing to ask (no remote tier, every block local, or a backoff)."""
        if self.link is None or class_id not in self.link.namespaces:
            return None
        chains = [self.manager.remote_candidates(class_id, model_id, tokens, extra_key, owner)
                  for tokens, extra_key in prompts]
        if not any(chains) or not self.link.store.available():
            return None
        return chains

    async def fetch(self, class_id: int, chains: list[list[bytes]], *, read: bool = True) -> dict:
        """The remote tier's longest prefix of each chain: hash -> payload (``read`` False: -> None).

        Runs on a worker thread; past ``--remote-timeout`` the blocks count as missing (empty answer)
        and the tier backs off.  Never raises for the store's faults.
        """
        store = self.link.store
        asked = sum(map(len, chains))
        fut = store.submit_fetch(self.link.namespaces[class_id], chains, read=read)
        try:
            got = await asyncio.wait_for(asyncio.wrap_future(fut), store.settings.timeout)
        except asyncio.TimeoutError:
            store.slow()
            store.count_lookup(asked, 0)
            return {}
        store.count_lookup(asked, len(got.payloads))
        return got.payloads

    def staging(self, payloads: dict | None):
        """A context in which the engine copies ``payloads`` (from ``fetch``) into the blocks promoted from
        the remote tier; nothing to stage (None or empty): a context that does nothing."""
        return self._staged(payloads) if payloads else nullcontext()

    @contextmanager
    def _staged(self, payloads: dict):
        self.link.staged = payloads
        try:
            yield
        finally:
            self.link.staged = {}


__all__ = ["RemoteLookups"]
