"""The stages of a run, one module each: profile, rank, generate, verify, host, integrate."""
