"""pooling rules (being written)."""
