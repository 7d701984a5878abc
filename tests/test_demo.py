"""The README's main command stays true: the demo runs and shows the shared prefix."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_script_shares_the_prefix_and_prints_stats():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "worker-a: prompt 389 tokens, 0 found in the pool" in out.stdout
    assert "worker-b: prompt 387 tokens, 384 found in the pool (prefill computed 3)" in out.stdout
    assert "prefix hits" in out.stdout and "demo-llama" in out.stdout
    # two kvpool serve processes: the second finds the first's prompt (two full blocks of 8 of its 21 tokens)
    assert '"prompt_tokens":21' in out.stdout and '"cached_tokens":0' in out.stdout
    assert "serve-b: prompt 21 tokens, 16 found in the pool" in out.stdout
    assert "serve-b: chat, streamed:" in out.stdout
    assert "kvpool_serve_prefix_hit_tokens_total 16.0" in out.stdout
