"""CI runs exactly the README's install, example and test commands; README and docs link only to existing files; the
README's memory table is rendered from the results."""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md",
         ROOT / "benchmarks" / "results" / "latest.md"]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert len(commands) == 3
    positions = [ci.index(command) for command in commands]
    assert positions == sorted(positions)


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_links_point_to_files_that_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
        for target in targets:
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing


def test_the_memory_table_reads_from_the_results():
    """The README's memory table is the one `benchmarks/memory_gather.py` renders from memory_like_for_like.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_gather
    finally:
        sys.path.pop(0)
    rows = json.loads((ROOT / "benchmarks" / "results" / "memory_like_for_like.json").read_text())["rows"]
    assert memory_gather.readme_table(rows) in (ROOT / "README.md").read_text()
