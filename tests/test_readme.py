"""The README's example runs as written: the first ```python block of README.md, in a
fresh interpreter (it sets XLA_FLAGS itself, before jax starts), prints a plan."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAXWAP_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("jaxwap plan: "), done.stdout[:500]
    assert "candidates (every mesh considered):" in done.stdout
