"""A request's text as its tokens arrive: deltas for streaming, and stop strings."""

from __future__ import annotations


class TextTracker:
    """Decodes a request's output tokens and watches for its stop strings.

    The whole output is decoded again on each token: tokenizers join pieces
    (spaces, multi-byte characters) depending on their neighbours, so decoding
    token by token would not give the same text.  Text that may still turn
    into a stop string, or ends in an incomplete character, is held back from
    the deltas until it is decided.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], skip_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._skip = skip_ids  # eos / stop ids: they end the text, they are not part of it
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # final: up to the stop string when one was found
        self._sent = 0

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """Decode ``token_ids`` (the whole output so far).

        Returns:
            (the new text that can be sent now, whether a stop string was found).
        """
        ids = [t for t in token_ids if t not in self._skip]
        full = self._tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (full.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = full[:cut]
            return self._emit(len(self.text)), True
        self.text = full
        ready = len(full) - self._hold
        while ready > self._sent and full[ready - 1] == "\ufffd":  # a character still being spelled
            ready -= 1
        return self._emit(ready), False

    def flush(self) -> str:
        """The held-back tail, once the request has ended without a stop string."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta = self.text[self._sent:upto]
        self._sent = upto
        return delta
