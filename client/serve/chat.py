"""Chat messages to a prompt: the tokenizer's chat template, or a plain fallback."""

from __future__ import annotations

from ..errors import InvalidArgument

#: used when the tokenizer has no chat template: one "role: content" line per message, then "assistant:"
FALLBACK_TEMPLATE = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant:"


def message_text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidArgument("only text message parts are supported")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise InvalidArgument("a text part's text must be a string")
        parts.append(text)
    return "".join(parts)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered for generation (the assistant's turn next).

    Raises:
        InvalidArgument: no messages, or non-text parts.
    """
    if not messages:
        raise InvalidArgument("messages must not be empty")
    plain = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "".join(FALLBACK_TEMPLATE.format(**m) for m in plain) + FALLBACK_GENERATION_PROMPT
    return tokenizer(text, add_special_tokens=True)["input_ids"]
