"""Verification: correctness and timing of candidate kernels, in isolated workers.

Entry point: verify.harness.verify_candidate. The checks live in checks.py (the suite),
numerics.py and integrity.py; the tolerance table in tolerances.py; process isolation in
worker.py; all timing in timing.py (bootstrap statistics in stats.py).
"""
