"""The README's Python example, as a user runs it, under ``python -O``.

``-O`` (or ``PYTHONOPTIMIZE=1``, common in production images) strips every ``assert``; the engine
must not depend on one (``test_code_rules.py`` checks the source, this runs the real thing).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_example() -> str:
    """The first ```python block of the README (the offline API example)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


@pytest.mark.slow
def test_readme_example_runs_under_python_O(tmp_path):
    code = readme_python_example()
    assert "LLM()" in code, "the first example is expected to run the bundled model"
    script = tmp_path / "example.py"
    script.write_text(code + "\nassert False, 'asserts must be stripped under -O'\nprint('EXAMPLE-DONE')\n")
    done = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "EXAMPLE-DONE"
    assert len([ln for ln in lines if ln.strip()]) >= 4, done.stdout  # it printed its generations
