"""Pallas kernels for xlm, importable on their own (they never import xlm)."""
