"""benchmarks/host_profile.py on the CPU (its --device cpu dry run, under the interpreter): each
family's patched calls are counted per pass, and the cProfile difference names the rendered
kernel's forward on the patched side and the HF code it replaced on the other."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "host_profile.py"


def test_dry_run_counts_calls_and_names_what_the_patch_swapped(tmp_path):
    out = tmp_path / "hp.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--model", "tiny-llama", "--batch", "1",
         "--seq", "8", "--device", "cpu", "--pairs", "2", "--passes", "1",
         "--families", "rmsnorm,kv_cache"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    sets = result["sets"]
    assert list(sets) == ["rmsnorm", "kv_cache", "rmsnorm+kv_cache"]
    # tiny-llama: 2 layers, two RMSNorms each plus the final one; one cache update per layer
    assert [sets[k]["calls_per_pass"] for k in sets] == [5, 2, 7]
    for name, replaced in (("rmsnorm", "modeling_llama.py"), ("kv_cache", "cache_utils.py")):
        added = {d["function"] for d in sets[name]["added"]}
        assert any(f.endswith("(forward)") and f"/{name}/" in f for f in added), added
        assert any(f.startswith("codegen/launch.py") for f in added), added
        removed = {d["function"] for d in sets[name]["removed"]}
        assert any(replaced in f for f in removed), removed
        assert not any(f.startswith("codegen/") for f in removed), removed
