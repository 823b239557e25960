"""The README's Python example, run as written in a fresh interpreter."""

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_python_example_runs(cluster):
    text = README.read_text()
    match = re.search(r"<!-- python-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md has no python-example block"
    result = subprocess.run([sys.executable, "-c", match.group(1)], capture_output=True,
                            text=True, env=dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stderr
    # ids 50..9999 pass the filter: 995 in each of the 10 buckets.
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [row[1:3] for row in rows] == [[str(b), "995"] for b in range(10)], result.stdout
