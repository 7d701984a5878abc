"""OpenAI response bodies and server-sent-event chunks, built from the engine's ``RequestOutput``."""

from __future__ import annotations

import json
import time
import uuid

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class ResponseShape:
    """The ids, names and shapes of one completion or chat completion response.

    Args:
        chat: chat completion (``message`` / ``delta``) rather than completion (``text``).
        model: the served model name.
    """

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(out) -> dict:
        done = len(out.token_ids)
        return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": done,
                "total_tokens": out.num_prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def full(self, out) -> dict:
        """The non-streaming body of a finished request."""
        reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": reason}
        return {**self._head(False), "choices": [choice], "usage": self.usage(out)}

    def chunk(self, text: str, finish_reason: str | None, *, first: bool = False) -> str:
        """One SSE event with a text delta (and the finish reason on the last)."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return sse({**self._head(True), "choices": [choice]})

    def usage_chunk(self, out) -> str:
        return sse({**self._head(True), "choices": [], "usage": self.usage(out)})


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
