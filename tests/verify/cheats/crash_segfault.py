"""Cheat: reads address 0 (a segmentation fault, as a bad pointer in a C extension)."""

import ctypes


def forward(x, weight, *, out, eps):
    ctypes.string_at(0)
