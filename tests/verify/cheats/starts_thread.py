"""Cheat (any family): leaves its work to a thread that outlives the call."""

import threading


def forward(*inputs, out, **params):
    threading.Thread(target=lambda: None).start()
