"""Cheat: never returns (a kernel that spins forever)."""

import time


def forward(x, weight, *, out, eps):
    while True:
        time.sleep(3600)
