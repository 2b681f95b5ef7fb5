"""CI runs exactly the README's install, example and test commands."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert len(commands) == 3
    positions = [ci.index(command) for command in commands]
    assert positions == sorted(positions)
