"""The whole-model projection, in one place: what a set of kernels at their measured speedups
should do to the pass, from kernel-level numbers and in-model host deltas alone.

- `replay`: the profiled pass's trace replayed with rows replaced, eagerly or as one CUDA graph
- `workload`: one workload's projection for a set of patterns (Amdahl, replay, graphs)
- `host`: host-delta accounting (the in-model deltas at the profile's host speed, the set's)
- `frozen`: projection.json, frozen before integration, and the shipped set's projection after
- `gap`: where a projection and its measurement part, family by family

The stages call it; it calls no stage (tests/house/test_layers.py checks).
"""
