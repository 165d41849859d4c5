"""Model implementations whose attention reads and writes the paged KV cache."""
