"""Native CPU kernels (compiled on first use; see each module)."""
