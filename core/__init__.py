"""The ground floor: shared types and I/O that every other package may import.

Errors, schema-versioned artifacts, the workload, the environment record, the kernel-family
contract and candidate source loading. Nothing here imports another package of the project
(`models/` aside, which imports nothing of the project itself).
"""
