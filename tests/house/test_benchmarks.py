"""The benchmarks folder stays something a newcomer can read: every script in it says what it is
for in benchmarks/README.md, and benchmarks/results/ holds the current table and the runs behind
it, not every run ever made (older ones are in git history)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
# bytes of the files under benchmarks/results/ (what a clone carries; directories not counted,
# their size is the filesystem's)
RESULTS_BYTES = 10_000_000


def test_every_benchmark_script_is_listed_with_its_purpose():
    table = [line for line in (BENCH / "README.md").read_text().splitlines()
             if line.startswith("| `")]
    listed = {line.split("`")[1] for line in table}
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts <= listed, f"not in benchmarks/README.md's table: {sorted(scripts - listed)}"
    # a row with a script's name and nothing said of it does not count
    empty = [line for line in table if len(line.strip().strip("|").split("|")[-1].strip()) < 10]
    assert not empty, empty


def test_the_results_folder_stays_under_its_size():
    size = sum(p.stat().st_size for p in (BENCH / "results").rglob("*") if p.is_file())
    assert size <= RESULTS_BYTES, (
        f"benchmarks/results/ holds {size / 1e6:.2f} MB (at most {RESULTS_BYTES / 1e6:.0f}): "
        "leave older run folders, traces and logs to git history")
