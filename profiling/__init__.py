"""Capture (torch.profiler), attribution (kernel -> op -> module -> pattern), HTA, replay."""
