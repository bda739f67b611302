"""The environment a measurement was taken in (goes into every artifact that holds timings)."""

from __future__ import annotations

import os
import platform

# CPU timings run on one intra-op thread. With torch's default of one per core, every op waits
# for its slowest thread, and a core held by another process stretches the pass by up to
# 100x (issue #65: a 1.3 ms tiny-gpt2 forward took 116 ms with two threads, 1.28 ms with
# one); the CPU runs tiny models, which one thread runs as fast as two on a quiet machine.
CPU_TIMING_THREADS = 1


def steady_cpu_timing() -> None:
    """One intra-op thread for torch here, and for torch and numpy's BLAS (the Triton
    interpreter's arithmetic) in every worker process started from here on."""
    import torch

    torch.set_num_threads(CPU_TIMING_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(CPU_TIMING_THREADS)


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        env["sm_count"] = props.multi_processor_count
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["gpu"] = None
    return env
