"""A tiny random-weight Llama in a local directory (nothing downloaded), sized for vLLM's CPU backend."""

from __future__ import annotations


def build_tiny_llama(path: str, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # CPU_ATTN: head size in {32, 64, ...}, block size a multiple of 32
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path
