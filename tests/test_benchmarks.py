"""`python -m benchmarks`: one entry point that lists every measurement and runs the one named."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def benchmarks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_help_lists_every_measurement_and_the_readme_names_each():
    listed = benchmarks("--help")
    assert listed.returncode == 0
    names = [line.split()[0] for line in listed.stdout.splitlines()[2:] if line.strip()]
    scripts = {p.stem for pattern in ("*.py", "*.sh") for p in (ROOT / "benchmarks").glob(pattern)}
    assert set(names) == scripts - {"__main__", "harness", "criterion", "multi_gpu_worker"}
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert [name for name in names if f"`{name}`" not in readme] == []


def test_runs_the_named_measurement_with_its_arguments():
    ran = benchmarks("dpo_step", "--help")
    assert ran.returncode == 0 and "--splits" in ran.stdout


def test_an_unknown_name_is_refused_with_the_list():
    ran = benchmarks("no_such_measurement")
    assert ran.returncode == 2 and "trainer_step" in ran.stderr
