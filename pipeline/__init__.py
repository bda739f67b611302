"""Staged pipeline: profile -> rank -> generate -> verify -> integrate -> report."""
