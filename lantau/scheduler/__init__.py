"""Token-budget scheduler and its typed outputs (no torch)."""
