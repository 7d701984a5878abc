"""A request's text as its tokens arrive: deltas for streaming, and stop strings."""

from __future__ import annotations


class TextTracker:
    """Decodes a request's output tokens incrementally and watches for its stop strings.

    Tokenizers join pieces (spaces, multi-byte characters) depending on their
    neighbours, so a token's text is the difference between decoding a short
    window that ends with it and the same window without it; the window moves
    on once a token decodes to whole characters (the method of Hugging Face's
    text-generation-inference and vLLM).  Each token costs a decode of a few
    tokens, not of the whole output.  Text that may still turn into a stop
    string is held back from the deltas until it is decided.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], skip_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._skip = skip_ids  # eos / stop ids: they end the text, they are not part of it
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._count = 0  # tokens of the output taken so far
        self._prefix = self._read = 0  # the window: ids[_prefix:_read] are decoded into the text already
        self.text = ""  # final: up to the stop string when one was found
        self._sent = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """Take the tokens of ``token_ids`` (the whole output so far) that are new since the last call.

        Returns:
            (the new text that can be sent now, whether a stop string was found).
        """
        seen = len(self.text)
        self._ids.extend(t for t in token_ids[self._count:] if t not in self._skip)
        self._count = len(token_ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # whole characters: move the window on
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        window = max(0, seen - self._hold)  # a stop string may begin in the held-back tail
        cut = min((i for i in (self.text.find(s, window) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._hold), False

    def flush(self) -> str:
        """The held-back tail, once the request has ended without a stop string."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta = self.text[self._sent:upto]
        self._sent = upto
        return delta
