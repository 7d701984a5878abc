"""The three models of bench_multimodel.py and its traces.

Models: the published shapes of Llama-3.2-1B (head_dim 64), Qwen2.5-1.5B
(head_dim 128) and Gemma-2-2B (head_dim 256, sliding window, logit soft caps)
with random weights, or tiny models of the same three architectures for the
CPU.  Nothing is downloaded: the configs are written out here.

Traces: prompts are random token ids, a share of them behind one of a few
system prompts per model; prompt and output lengths are log-normal with the
means of ShareGPT that the vLLM paper reports (bench_memory.py), scaled down
for the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from bench_memory import MEAN_INPUT, MEAN_OUTPUT
from bench_serve import llama_1b_config


# -- models ----------------------------------------------------------------------------------------
def qwen25_15b_config():
    """The published config of Qwen2.5-1.5B."""
    import transformers

    return transformers.Qwen2Config(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
    )


def gemma2_2b_config():
    """The published config of Gemma-2-2B: sliding and full layers alternate, attention and final soft caps."""
    import transformers

    return transformers.Gemma2Config(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rope_theta=10000.0,
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )


TINY = dict(num_hidden_layers=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_llama():
    import transformers

    return transformers.LlamaConfig(**TINY, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16)


def tiny_qwen2():
    import transformers

    return transformers.Qwen2Config(**TINY, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, use_sliding_window=False)


def tiny_gemma2():
    import transformers

    return transformers.Gemma2Config(**TINY, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
                                     attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


@dataclass(frozen=True)
class ModelSpec:
    key: str  # the served model name
    published: Callable  # () -> transformers config of the published shape
    tiny: Callable  # () -> a tiny config of the same architecture


MODELS = {
    "llama": ModelSpec("llama", llama_1b_config, tiny_llama),
    "qwen": ModelSpec("qwen", qwen25_15b_config, tiny_qwen2),
    "gemma": ModelSpec("gemma", gemma2_2b_config, tiny_gemma2),
}

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """What the benchmark needs to know of a built model: its vocabulary, KV size and pool geometry."""

    key: str
    vocab: int
    max_len: int  # max_position_embeddings
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token: K and V of every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_size

    @property
    def geometry(self) -> str:
        """The layout class's name in the daemon's stats (``Geometry.describe`` without the tenant)."""
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype}-bs{self.block_size}"


def shape_of(key: str, config, dtype: str, block_size: int) -> ModelShape:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(key, config.vocab_size, config.max_position_embeddings, config.num_hidden_layers,
                      config.num_key_value_heads, head_dim, dtype, block_size)


def build_model_dir(spec: ModelSpec, out: str, *, tiny: bool, dtype: str, device: str, seed: int) -> str:
    """Save ``spec``'s model with random weights (``save_pretrained``) into ``out``."""
    import torch
    import transformers

    config = spec.tiny() if tiny else spec.published()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


# -- traces ----------------------------------------------------------------------------------------
@dataclass
class Request:
    model: str
    arrival: float  # seconds after the trace starts
    prompt: list[int]
    max_tokens: int
    system: int = -1  # which system prompt it starts with; -1: none
    tag: str = ""


@dataclass
class TraceMaker:
    """Requests with ShareGPT-like lengths, a share of them behind one of each model's system prompts.

    ``scale`` multiplies the ShareGPT means (1.0 on the GPU); lengths are log-normal with sigma 1.0
    (bench_memory.py) and clipped to ``max_prompt`` / ``max_output``.
    """

    shapes: dict[str, ModelShape]
    seed: int = 0
    scale: float = 1.0
    max_prompt: int = 2048
    max_output: int = 512
    system_lens: tuple[int, ...] = (256, 512, 1024)
    shared: float = 0.7  # share of prompts behind a system prompt
    rng: np.random.Generator = field(init=False)
    systems: dict[str, list[list[int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.systems = {k: [self._ids(k, n) for n in self.system_lens] for k in self.shapes}

    def _ids(self, model: str, n: int) -> list[int]:
        return self.rng.integers(10, self.shapes[model].vocab, n).tolist()

    def _length(self, mean: float, most: int) -> int:
        mean *= self.scale
        return int(np.clip(round(self.rng.lognormal(math.log(mean) - 0.5, 1.0)), 1, most))

    def request(self, model: str, arrival: float, tag: str) -> Request:
        prompt = self._ids(model, self._length(MEAN_INPUT, self.max_prompt))
        system = int(self.rng.integers(len(self.system_lens))) if self.rng.random() < self.shared else -1
        if system >= 0:
            prompt = self.systems[model][system] + prompt
        return Request(model, arrival, prompt, self._length(MEAN_OUTPUT, self.max_output), system, tag)

    def poisson(self, model: str, rate: float, start: float, end: float, tag: str) -> list[Request]:
        out, t = [], start
        while True:
            t += self.rng.exponential(1.0 / rate)
            if t >= end:
                return out
            out.append(self.request(model, t, tag))

    def burst(self, model: str, count: int, start: float, window: float) -> list[Request]:
        """``count`` requests arriving over ``window`` seconds from ``start`` (Poisson arrivals)."""
        gaps = self.rng.exponential(1.0, count + 1)
        times = start + window * np.cumsum(gaps)[:-1] / gaps.sum()
        return [self.request(model, float(t), "burst") for t in times]

    def long_prompt(self, model: str, n: int) -> list[int]:
        return self._ids(model, n)

    def kv_bytes(self, reqs: list[Request]) -> int:
        """KV bytes ``reqs`` (of one model) hold when all are at their last token; system prompts count once."""
        if not reqs:
            return 0
        shape = self.shapes[reqs[0].model]
        bs = shape.block_size
        sys_len = [len(s) for s in self.systems[reqs[0].model]]
        private = sum(-(-(len(r.prompt) - (sys_len[r.system] if r.system >= 0 else 0) + r.max_tokens) // bs)
                      for r in reqs)
        shared = sum(-(-sys_len[i] // bs) for i in {r.system for r in reqs if r.system >= 0})
        return (private + shared) * shape.block_bytes
