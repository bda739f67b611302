"""Put Ray's wheels for the H200 machine into .whl/ (run here, in the repo root, before a device
call that carries `.whl`). Ray is not on that machine's image. Its wheel is 79 MB, over the
64 MiB a call may carry; without ray/jars/ (the Java workers, unused here) it is 47 MB.

    python benchmarks/ray_wheels.py && echo /.whl/ >> .git/info/exclude
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

RAY = "ray==2.60.0"
# what `import ray` needs that the image lacks (its other needs are there)
EXTRA = ["jsonschema", "jsonschema-specifications", "referencing", "rpds-py"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def main() -> None:
    out = Path(".whl")
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(out), RAY, *EXTRA]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)
    for wheel in out.glob("ray-*.whl"):
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():  # the ZipInfo keeps each file's mode (raylet: +x)
                if not info.filename.startswith("ray/jars/"):
                    dst.writestr(info, src.read(info))
        tmp.replace(wheel)
    total = sum(f.stat().st_size for f in out.glob("*.whl"))
    print(f"{out}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
