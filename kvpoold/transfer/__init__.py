"""Block copies between tiers (filled in with the memory hierarchy)."""
