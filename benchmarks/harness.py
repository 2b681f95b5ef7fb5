"""What every measurement shares: its run folder (JSON rows, a markdown table, a generated manifest), the
environment it ran in, peak device memory, and `KEY=VALUE` options.

    run = RunFolder("dpo_step", out)           # benchmarks/results/<date>_dpo_step unless `out` names a folder
    run.write(rows, table_lines)               # dpo_step.json, dpo_step.md and MANIFEST.md, after every row

The manifest holds the command as typed, the date, the commit, the device and the library versions; a device copy of
the repository may carry a stale git HEAD, so `PREFIXFLOW_COMMIT` in the environment overrides it.
"""

from __future__ import annotations

import ast
import datetime
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "flash-linear-attention", "triton")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def git_commit() -> str:
    """The commit the run's code is at: `PREFIXFLOW_COMMIT` if set, else git's HEAD (with `+` for local changes)."""
    if os.environ.get("PREFIXFLOW_COMMIT"):
        return os.environ["PREFIXFLOW_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def environment() -> dict:
    """Where a row ran: device, commit, date and library versions."""
    return {"gpu": device_name(), "commit": git_commit(), "date": datetime.date.today().isoformat(), **versions()}


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    """Peak allocated device memory since the last `reset_peak`, in GiB (None on a CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def options(text: str) -> dict:
    """`KEY=VALUE,...` with VALUE as a Python literal where it parses as one (true/false as booleans)."""
    parsed = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        value = {"true": "True", "false": "False"}.get(value.lower(), value)
        try:
            parsed[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed[key] = value
    return parsed


class RunFolder:
    """A measurement's output folder: `<name>.json` (rows), `<name>.md` (the table) and `MANIFEST.md`.

    Args:
        name: the measurement (`benchmarks/<name>.py`), the files' stem.
        out: the folder; None: `benchmarks/results/<date>_<name>`.
        tag: the files' stem instead of `name` (several runs in one folder).
        argv: the measurement's arguments, for the command line it records (default: `sys.argv[1:]`).
    """

    def __init__(self, name: str, out: str | pathlib.Path | None = None, tag: str | None = None,
                 argv: list[str] | None = None):
        self.name, self.stem = name, tag or name
        self.path = pathlib.Path(out or ROOT / "benchmarks" / "results" /
                                 f"{datetime.date.today().isoformat()}_{self.stem}")
        self.command = "python -m benchmarks " + " ".join([name, *(sys.argv[1:] if argv is None else argv)])
        self.environment = environment()

    def write(self, rows: list[dict], table: list[str]) -> None:
        """Write the rows, the table under a line naming the command and environment, and the manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"{self.stem}.json").write_text(json.dumps(rows, indent=1, default=str))
        (self.path / f"{self.stem}.md").write_text("\n".join([f"`{self.command}`; {self.describe()}", "", *table])
                                                   + "\n")
        self._update_manifest(len(rows))

    def describe(self) -> str:
        env = self.environment
        libraries = ", ".join(f"{k} {v}" for k, v in env.items() if k in LIBRARIES)
        return f"{env['gpu']}, commit {env['commit']}, {env['date']}; {libraries}"

    def _update_manifest(self, rows: int) -> None:
        """One section per file stem in a generated MANIFEST.md (a hand-written one is left alone)."""
        manifest = self.path / "MANIFEST.md"
        text = manifest.read_text() if manifest.exists() else GENERATED + f"# Runs in {self.path.name}\n"
        if not text.startswith(GENERATED):
            return
        sections = text.split("\n## ")
        own = (f"{self.stem}\n\n- command: `{self.command}`\n- run: {self.describe()}\n"
               f"- files: `{self.stem}.json` ({rows} rows), `{self.stem}.md` (the table)\n")
        sections = [section for section in sections[1:] if not section.startswith(self.stem + "\n")]
        manifest.write_text("\n## ".join([text.split("\n## ")[0].rstrip("\n") + "\n", *sections, own]))


GENERATED = "<!-- generated by benchmarks/harness.py -->\n"
