"""normalization rules (being written)."""
