"""Choosing each request's next token from its logits: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch


class Sampler:
    """Turns one step's logits into tokens, one row per request.

    Greedy rows share one ``argmax``.  Sampled rows each draw with their
    request's own ``torch.Generator``, so a seeded request gets the same
    tokens whatever else is in its batch.  The draw is ``argmax(p / e)``
    with ``e ~ Exp(1)`` (the exponential race), which picks token ``i`` with
    probability ``p_i`` and, unlike ``multinomial``, needs no cumulative sum
    whose rounding depends on the vocabulary's order.
    """

    def sample(self, logits: torch.Tensor, requests: list) -> list[int]:
        """Args:
            logits: ``[len(requests), vocab]``, any float dtype.
            requests: the rows' ``Request`` objects (their ``params`` and ``generator``).

        Returns:
            One token id per row.
        """
        logits = logits.float()
        chosen = logits.argmax(-1).tolist()
        for row, req in enumerate(requests):
            if not req.params.greedy:
                chosen[row] = self._draw(logits[row], req.params, req.generator)
        return chosen

    @staticmethod
    def _draw(logits: torch.Tensor, params, generator: torch.Generator) -> int:
        logits = logits / params.temperature
        if params.top_k and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p: a token stays if the mass before it is < top_p
            drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        race = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / race).argmax())
