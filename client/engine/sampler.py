"""Choosing each request's next token from its logits: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MIX = 0x045D9F3B  # under 2**31: a 32-bit value times it stays inside int64, no overflow


def _mix32(x):
    """A 32-bit integer hash (xor-shift-multiply rounds) of ints or int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def draw_keys(seed: int, index: int) -> tuple[int, int]:
    """The two 32-bit keys of draw number ``index`` (the output position) of a request seeded ``seed``."""
    seed &= (1 << 64) - 1
    k1 = _mix32((seed & _MASK32) ^ _mix32((index & _MASK32) ^ _mix32(seed >> 32)))
    return k1, _mix32(k1 ^ 0x2545F491)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise ``[rows, vocab]`` from a counter-based hash of (row keys, token id).

    ``keys``: int64 ``[rows, 2]`` (``draw_keys``).  The same keys give the
    same noise on any device and in any batch: a draw depends on the
    request's seed and output position only, so a seeded request repeats its
    tokens whatever runs beside it, and a preempted one resumes with them.
    """
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    h = _mix32(_mix32(ids ^ keys[:, :1]) ^ keys[:, 1:])
    uniform = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1): 24 bits, float32's mantissa
    return -torch.log(uniform)


class Sampler:
    """Turns one step's logits into tokens, one row per request, in a fixed number of batched ops.

    Greedy rows take the ``argmax``.  Sampled rows are scaled by their
    temperatures, cut to their top-k and top-p sets (per-row values, one
    sort for the batch), and draw with the exponential race ``argmax(p / e)``
    with ``e ~ Exp(1)``: token ``i`` wins with probability ``p_i``, with no
    cumulative sum whose rounding depends on the vocabulary's order.  The
    noise comes from ``exponential_noise`` keyed by each request's seed and
    output position, not from a generator's state.
    """

    def sample(self, logits: torch.Tensor, requests: list, positions: list[int] | None = None) -> list[int]:
        """``choose`` read back as a list of ints (a wait for the device)."""
        return self.choose(logits, requests, positions).tolist()

    def choose(self, logits: torch.Tensor, requests: list, positions: list[int] | None = None) -> torch.Tensor:
        """Args:
            logits: ``[len(requests), vocab]``, any float dtype.
            requests: the rows' ``Request`` objects (``params``, ``seed``, ``output``).
            positions: each row's output position, which keys its draw (default: ``len(request.output)``, the
                next one; a step that runs before the last one's tokens are read back draws one further).

        Returns:
            One token id per row (int64, on the logits' device; nothing waits for it).
        """
        chosen = logits.argmax(-1)
        rows = [i for i, req in enumerate(requests) if not req.params.greedy]
        if rows:
            at = [len(requests[i].output) if positions is None else positions[i] for i in rows]
            picked = self._draw(logits[rows].float(), [requests[i] for i in rows], at)
            chosen[rows] = picked
        return chosen

    @staticmethod
    def _draw(logits: torch.Tensor, requests: list, positions: list[int]) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[-1]
        params = [r.params for r in requests]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(dev, non_blocking=True)
        logits = logits / temps[:, None]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = Sampler._truncate(logits, top_k, top_p)
        probs = torch.softmax(logits, -1)
        keys = torch.tensor([draw_keys(r.seed, at) for r, at in zip(requests, positions)], dtype=torch.int64)
        race = exponential_noise(keys.to(dev, non_blocking=True), vocab)
        return (probs / race).argmax(-1)

    @staticmethod
    def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask what each row's top-k and top-p leave out (``-inf``), with one descending sort."""
        dev, vocab = logits.device, logits.shape[-1]
        ordered, order = logits.sort(-1, descending=True)
        k = torch.tensor([kk or vocab for kk in top_k], dtype=torch.int64).to(dev, non_blocking=True)
        drop = torch.arange(vocab, device=dev)[None, :] >= k[:, None]
        if any(p < 1.0 for p in top_p):
            probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), -1)
            # keep the smallest set whose mass reaches top_p: a token stays if the mass before it is < top_p
            limit = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], dtype=torch.float32)
            drop |= (probs.cumsum(-1) - probs) >= limit.to(dev, non_blocking=True)[:, None]
        return logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
