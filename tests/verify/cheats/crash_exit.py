"""Cheat: exits the process from inside forward."""

import os


def forward(x, weight, *, out, eps):
    os._exit(3)
