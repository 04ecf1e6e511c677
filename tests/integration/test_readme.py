"""The README's client example runs as written, against a real execd."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_client_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    example = next(block for block in blocks if "asyncio.run(main())" in block)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})  # noqa: S102
    assert (tmp_path / "notes" / "todo.txt").read_bytes() == b"ship it\n"
