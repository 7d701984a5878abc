"""Two model processes, one system prompt: the second reuses the first's blocks (examples/hf_shared_prefix.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_shared_prefix.py"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_shared_prefix", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_second_process_skips_the_cached_system_prompt(daemon):
    ex = load_example()
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--socket", daemon.socket, "--check", "--json", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = summary["workers"]
    bs = 16
    sa = ex.encode(ex.SYSTEM_PROMPT + "\n" + ex.QUESTIONS["worker-a"], None, 1024)
    sb = ex.encode(ex.SYSTEM_PROMPT + "\n" + ex.QUESTIONS["worker-b"], None, 1024)
    common = next(i for i, (x, y) in enumerate(zip(sa, sb)) if x != y)
    assert a["cached_tokens"] == 0 and a["computed_tokens"] == a["prompt_tokens"]
    assert b["cached_tokens"] == common // bs * bs > 0  # every full block of the shared prefix
    assert b["computed_tokens"] == b["prompt_tokens"] - b["cached_tokens"]
    assert a["matches_eager"] is True and b["matches_eager"] is True  # B's tokens read A's K/V
    # the pool, while both hold their sequences: the prefix blocks are held once
    assert summary["shared_blocks"] == common // bs
    (cls,) = summary["stats"]["classes"]
    assert cls["prefix_hits"] == 1 and cls["prefix_hit_tokens"] == b["cached_tokens"]
    assert cls["used_blocks"] - cls["reserved_blocks"] == len(set(a["blocks"]) | set(b["blocks"]))
    # and kvpoolctl shows it
    assert "$ kvpoolctl --socket" in out.stdout and "prefix hits" in out.stdout
    assert "random-llama-seed0" in out.stdout


def test_example_loads_a_saved_model_folder(tmp_path):
    """--model takes a from_pretrained folder (here a saved random model; no tokenizer: ids only)."""
    from hf_models import make_model

    make_model("qwen2").save_pretrained(tmp_path)
    ex = load_example()
    model, tok, model_id = ex.build_model(Namespace(model=str(tmp_path), arch="llama"))
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok is None and model_id == str(tmp_path)
