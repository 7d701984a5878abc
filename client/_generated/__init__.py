"""Code generated from protos/kvpool.proto by scripts/gen_protos.py (never edited by hand)."""
