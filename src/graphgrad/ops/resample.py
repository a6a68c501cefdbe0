"""resample rules (being written)."""
