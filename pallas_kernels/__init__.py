"""Pallas GPU PagedAttention kernels (the kernel issue fills this package)."""
