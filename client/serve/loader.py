"""Loading a transformers checkpoint and its tokenizer from a local directory (nothing is downloaded)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

DTYPES = {"auto": "auto", "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(path: str, *, dtype: str = "auto", device: str | None = None):
    """The causal LM in ``path`` on ``device`` (default: CUDA when there is one), in the checkpoint's dtype
    unless ``dtype`` says otherwise.

    Returns:
        (model, tokenizer or None when the directory has none).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise SystemExit(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if not Path(path, "config.json").is_file():
        raise SystemExit(f"--model {path}: not a transformers model directory (no config.json)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True).to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    return model.eval(), tokenizer


def weights_fingerprint(path: str) -> str:
    """A short id of the checkpoint's files (names, sizes, modification times).

    It is the layout's revision: processes share pool blocks only when their
    layouts match, so two servers of the same files share prefixes and a
    changed checkpoint never reads the old one's K/V.
    """
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]
