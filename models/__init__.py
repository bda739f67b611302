"""Model loading (hub, local folder, offline zoo) and per-instance model patching."""
