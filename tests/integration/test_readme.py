"""Every Python program the README shows is a file in examples/, so it runs as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_programs_are_the_examples() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    examples = {path.name: path.read_text() for path in (ROOT / "examples").glob("*.py")}
    assert blocks, "the README shows no program"
    shown = set()
    for block in blocks:
        matches = [name for name, text in examples.items() if text == block]
        assert matches, f"a README program is not a file in examples/:\n{block[:300]}"
        shown.update(matches)
    # The programs every reader meets: the quick start and the embedding.
    assert {"quickstart.py", "workspace.py"} <= shown
