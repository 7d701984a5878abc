"""A tiny random-weight Llama and a word-level tokenizer built on this machine (nothing downloaded).

    python3 -m kvpool.serve.demo_model DIR     # then: kvpool serve --model DIR ...

For demos and tests of ``kvpool serve``: the weights are random, so the
answers are random words of the tokenizer's vocabulary.
"""

from __future__ import annotations

import sys

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a pool of blocks holds the keys and values of every sequence",
    "two servers share one prefix through the daemon",
    "hello world this is a tiny model that says random words",
]


def demo_tokenizer(vocab_size: int = 256):
    """Words of ``SENTENCES`` first, then ``w<i>`` fillers up to ``vocab_size``; ``</s>`` (id 2) is eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"]
    for s in SENTENCES:
        words += [w for w in s.split() if w not in words]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_demo_model(path: str, *, seed: int = 0) -> str:
    """Save a 2-layer Llama (hidden 64, GQA 4/2 heads, vocab 256, float32) and ``demo_tokenizer`` into ``path``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    demo_tokenizer().save_pretrained(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m kvpool.serve.demo_model DIR")
    print(build_demo_model(sys.argv[1]))
