"""Chat messages to prompt ids: the tokenizer's template when it has one, else the documented fallback."""

import pytest

from kvpool.serve.demo_model import demo_tokenizer as make_tokenizer

from kvpool.errors import InvalidArgument
from kvpool.serve.chat import chat_prompt_ids


def test_fallback_is_role_lines_then_the_assistant_turn():
    tok = make_tokenizer()
    ids = chat_prompt_ids(tok, [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}])
    assert ids == tok("user: hello world\nassistant:")["input_ids"]


def test_the_tokenizers_template_wins():
    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}dog{% endif %}"
    assert chat_prompt_ids(tok, [{"role": "user", "content": "hello world"}]) == tok("hello world dog")["input_ids"]


def test_no_messages_or_images_are_invalid():
    tok = make_tokenizer()
    with pytest.raises(InvalidArgument):
        chat_prompt_ids(tok, [])
    with pytest.raises(InvalidArgument):
        chat_prompt_ids(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
