"""Cheat: aborts the process (as a failed device assertion does)."""

import os


def forward(x, weight, *, out, eps):
    os.abort()
