"""Run ``nnx-es`` commands in one fresh interpreter and say their exit statuses and which watched modules it imported
(the spec tests' subprocess check: nothing ran, nothing was imported past the registry check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "drive"]

REPO = Path(__file__).resolve().parents[1]

#: runs nnx-es in-process, then says its exit status and which watched modules are imported
DRIVER = """
import json, sys
from nnx_es.cli.main import main
watch = json.loads(sys.argv[1])
codes = [main(argv) for argv in json.loads(sys.argv[2])]
print(json.dumps({"codes": codes, "imported": [m for m in watch if m in sys.modules]}))
"""


def drive(cwd: Path, commands: list[list[str]], watch: list[str]) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(watch), json.dumps(commands)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr
