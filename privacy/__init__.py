"""Privacy mechanisms and accounting (no Flower imports)."""
