"""Kernel families (one folder each: reference, Triton kernel, pattern, patch adapter)."""
