"""Cheat: returns without writing `out` (what the caller reads is whatever the buffer held)."""


def forward(x, weight, *, out, eps):
    return None
