"""What every measurement shares: its run folder (JSON rows, a markdown table, a generated manifest), the
environment it ran in, peak device memory, timing with the device synchronised, and `KEY=VALUE` options.

    run = RunFolder("dpo_step", out)           # benchmarks/results/<date>_dpo_step unless `out` names a folder
    run.write(rows, table_lines)               # dpo_step.json, dpo_step.md and MANIFEST.md, after every row
    run.attach("profile.txt", text)            # any other file of the run, listed in the manifest

The manifest holds the command as typed, the date, the commit, the device and the library versions; a device copy of
the repository may carry a stale git HEAD, so `PREFIXFLOW_COMMIT` in the environment overrides it.

Timing: `seconds(fn)` times one call (CUDA events on a GPU, wall time on the CPU), `median_seconds` warms up and
takes the median of timed calls, `timed` adds the peak allocated memory and the allocator's retries.

Triton: `one_triton_config()` narrows every autotuned kernel defined afterwards to one configuration, for fused
packages (flash-linear-attention) whose dozen configurations per kernel take longer to compile than a device call
allows; both sides of a comparison then run the same kernels.
"""

from __future__ import annotations

import ast
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "flash-linear-attention", "triton")


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


def environment(gpu: str | None = None) -> dict:
    """Where a row ran: device (`gpu`: instead of asking torch, e.g. in a process that must not touch CUDA), commit,
    date, Python and library versions."""
    return {"gpu": gpu or device_name(), "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "python": platform.python_version(), **versions()}


# -- device memory and time --------------------------------------------------------------------------------------

def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def allocated_gib() -> float | None:
    """Device memory allocated now, in GiB (None on a CPU): what a run starts from."""
    return round(torch.cuda.memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def peak_gib() -> float | None:
    """Peak allocated device memory since the last `reset_peak`, in GiB (None on a CPU)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def alloc_retries() -> int:
    """How often the allocator has had to free its cache and retry (each retry synchronises the device)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(fn: Callable[[], object]) -> float:
    """One call of `fn`: CUDA events around it on a GPU (the host queues it unhindered, then waits for the end
    event), wall time on the CPU."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   after_warmup: Callable[[], object] | None = None) -> float:
    """`warmup` untimed calls, the device synchronised, `after_warmup()`, then the median of `repeats` timed calls."""
    for _ in range(warmup):
        fn()
    sync()
    if after_warmup is not None:
        after_warmup()
    return statistics.median(seconds(fn) for _ in range(repeats))


def timed(fn: Callable[[], object], repeats: int, warm_up: Callable[[], object]) -> tuple[float, float | None, int]:
    """Median seconds of `fn` over `repeats` calls after one `warm_up()`, the peak allocated GiB over the timed calls
    (None on a CPU), and the allocator's retries over all of them (a run near the memory limit pays for each)."""
    retries = alloc_retries()
    warm_up()
    median = median_seconds(fn, repeats, warmup=0, after_warmup=reset_peak)
    return median, peak_gib(), alloc_retries() - retries


# -- options and the run folder ----------------------------------------------------------------------------------

def pick_config(configs: list) -> object:
    """The configuration `one_triton_config` keeps: four warps and the fewest pipeline stages where listed, else the
    first (Triton's own default launch is four warps)."""
    four = [c for c in configs if getattr(c, "num_warps", None) == 4]
    return min(four, key=lambda c: getattr(c, "num_stages", 0)) if four else configs[0]


def one_triton_config() -> str:
    """Every Triton autotuner built from now on keeps one configuration (`pick_config`): no autotuning. Call it
    before the fused package is imported (its kernels are decorated at import). Returns what a row should record."""
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.__init__

    def narrowed(self, fn, arg_names, configs, *args, **kwargs):
        original(self, fn, arg_names, [pick_config(list(configs))] if configs else configs, *args, **kwargs)

    Autotuner.__init__ = narrowed
    return "one configuration per Triton kernel (harness.pick_config), no autotuning"


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
        command: the command line as run, where it is not `python -m benchmarks <name> <argv>` (e.g. torchrun).
        gpu: the device to record instead of asking torch (`environment`).
    """

    def __init__(self, name: str, out: str | pathlib.Path | None = None, tag: str | None = None,
                 argv: list[str] | None = None, command: str | None = None, gpu: str | None = None):
        self.name, self.stem = name, tag or name
        self.path = pathlib.Path(out or ROOT / "benchmarks" / "results" /
                                 f"{datetime.date.today().isoformat()}_{self.stem}")
        self.command = command or "python -m benchmarks " + " ".join(
            [name, *(sys.argv[1:] if argv is None else argv)])
        self.environment = environment(gpu)
        self.files: dict[str, str] = {}  # each file written, and what it holds

    def write(self, rows: list[dict] | dict, table: list[str] | None = None, title: str | None = None) -> None:
        """Write the rows (a list, or a report as one object), the table under a line naming the command and
        environment (and a `# title` above it; no table: no markdown), and the manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"{self.stem}.json").write_text(json.dumps(rows, indent=1, default=str))
        self.files[f"{self.stem}.json"] = (f"{len(rows)} row{'s' * (len(rows) != 1)}" if isinstance(rows, list)
                                            else "the report")
        if table is not None:
            head = [f"# {title}", ""] if title else []
            (self.path / f"{self.stem}.md").write_text(
                "\n".join([*head, f"`{self.command}`; {self.describe()}", "", *table]) + "\n")
            self.files[f"{self.stem}.md"] = "the table"
        self._update_manifest()

    def attach(self, filename: str, content: str | dict | list | None = None, what: str = "") -> pathlib.Path:
        """Another file of the run (text as given, anything else as JSON; None: one the caller wrote), listed in the
        manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.path / filename
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content, indent=1, default=str))
        self.files[filename] = what
        self._update_manifest()
        return path

    def describe(self) -> str:
        env = self.environment
        libraries = ", ".join(f"{k} {v}" for k, v in env.items() if k in LIBRARIES)
        return f"{env['gpu']}, commit {env['commit']}, {env['date']}; {libraries}"

    def _update_manifest(self) -> None:
        """One section per file stem in a generated MANIFEST.md (a hand-written one is left alone)."""
        manifest = self.path / "MANIFEST.md"
        text = manifest.read_text() if manifest.exists() else GENERATED + f"# Runs in {self.path.name}\n"
        if not text.startswith(GENERATED):
            return
        sections = text.split("\n## ")
        files = ", ".join(f"`{name}`" + (f" ({what})" if what else "") for name, what in self.files.items())
        own = f"{self.stem}\n\n- command: `{self.command}`\n- run: {self.describe()}\n- files: {files}\n"
        sections = [section for section in sections[1:] if not section.startswith(self.stem + "\n")]
        manifest.write_text("\n## ".join([text.split("\n## ")[0].rstrip("\n") + "\n", *sections, own]))


GENERATED = "<!-- generated by benchmarks/harness.py -->\n"
