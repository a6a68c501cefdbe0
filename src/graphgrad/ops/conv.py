"""conv rules (being written)."""
