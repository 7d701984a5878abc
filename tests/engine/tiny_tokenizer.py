"""A word-level tokenizer built here from a few sentences (no download), sized to the tiny models' vocabulary."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a pool of blocks holds the keys and values of every sequence",
    "two servers share one prefix through the daemon",
    "hello world this is a tiny model that says random words",
]


def make_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Words of ``SENTENCES`` first, then ``w<i>`` fillers up to ``vocab_size``; ``</s>`` is id 2."""
    words = ["<unk>", "<s>", "</s>"]
    for s in SENTENCES:
        words += [w for w in s.split() if w not in words]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
