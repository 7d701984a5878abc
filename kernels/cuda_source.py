"""The CUDA C++ sources of the GPU kernels: ``cuda/*.cu``, shipped as package data.

* ``paged_attention.cu``: decode / prefill attention (``mma.sync``), the split merge and
  the KV write; ``cuda_runtime`` compiles it with CuPy, and the tests' CPU emulator as C++.
* ``paged_attention_sm90.cu``: the Hopper prefill kernel (warpgroup MMA), compiled
  appended to ``paged_attention.cu`` for sm_90a only.
* ``block_copy.cu``: the batched block copies of ``block_copy``.

``read`` puts a ``#line 1 "<file name>"`` directive in front of a file's text: CuPy
hands every ``RawModule`` to NVRTC under one fixed name (``kern.cu``), and the directive
makes compile errors (NVRTC's and g++'s) name the ``.cu`` file and its own line numbers.
It changes no generated code.
"""

from __future__ import annotations

import functools
from importlib import resources

PAGED_ATTENTION = "paged_attention.cu"
PAGED_ATTENTION_SM90 = "paged_attention_sm90.cu"
BLOCK_COPY = "block_copy.cu"

# The Hopper prefill kernel's fixed shape: MMA (consumer) warpgroups per CTA, keys per tile,
# ring stages; the constants of the same names in paged_attention_sm90.cu (``read_sm90``
# checks that they agree).
WG_GROUPS, WG_KEYS, WG_STAGES = 2, 128, 3
# The most size classes of page-aware decode's item order (``cuda_work.work_order``);
# the constant of the same name in paged_attention.cu (``read_attention`` checks it).
ORDER_CLASSES = 8


@functools.lru_cache(maxsize=None)
def read(name: str) -> str:
    """The text of ``cuda/<name>``, behind a ``#line 1 "<name>"`` directive."""
    text = resources.files(__package__).joinpath("cuda", name).read_text(encoding="utf-8")
    return f'#line 1 "{name}"\n{text}'


def read_declaring(name: str, declaration: str) -> str:
    """``read(name)``, checked to contain ``declaration``: a constant the host mirrors."""
    src = read(name)
    if declaration not in src:
        raise RuntimeError(f"{name} does not declare what cuda_source.py mirrors: {declaration}")
    return src


def read_attention() -> str:
    """``paged_attention.cu``, checked to declare the item-order classes the host mirrors."""
    return read_declaring(PAGED_ATTENTION, f"constexpr int ORDER_CLASSES = {ORDER_CLASSES};")


def read_sm90() -> str:
    """``paged_attention_sm90.cu``, checked to have the shape the planner sizes it by."""
    shape = f"constexpr int WG_GROUPS = {WG_GROUPS}, WG_KEYS = {WG_KEYS}, WG_STAGES = {WG_STAGES};"
    return read_declaring(PAGED_ATTENTION_SM90, shape)
