"""`python -m benchmarks <name> [args]`: run one measurement (`benchmarks/<name>.py`); `--help` lists them.

Run from the repository root. Each measurement is a script of this folder with its own `--help`; what each one
produces, and which README figure it backs, is in `benchmarks/README.md`.
"""

from __future__ import annotations

import ast
import pathlib
import runpy
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
# Modules the measurements import, and one rank of a multi-GPU run: not measurements themselves.
HELPERS = {"__main__", "__init__", "harness", "criterion", "multi_gpu_worker"}


def measurements() -> dict[str, str]:
    """Each measurement's name and the first line of its docstring."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem not in HELPERS:
            found[path.stem] = first_sentence(ast.get_docstring(ast.parse(path.read_text())) or "")
    for path in sorted(HERE.glob("*.sh")):
        comments = [line[2:] for line in path.read_text().splitlines()[1:] if line.startswith("# ")]
        found[path.stem] = first_sentence("\n".join(comments))
    return found


def first_sentence(text: str) -> str:
    return " ".join(text.split("\n\n")[0].split()).split(". ")[0].rstrip(".:")


def usage() -> str:
    table = measurements()
    width = max(map(len, table))
    return "\n".join([__doc__.splitlines()[0], ""] + [f"  {name:<{width}}  {line}" for name, line in table.items()])


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, args = argv[0], argv[1:]
    if name not in measurements():
        print(f"no measurement {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    script = HERE / f"{name}.py"
    if not script.exists():
        return subprocess.call(["bash", str(HERE / f"{name}.sh"), *args])
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
