"""Every reader of a small run works under ``ulimit -v 4G`` (address space, RLIMIT_AS).

A read-only log handle used to map 1 TiB of address space whatever the file's size, so under any
``ulimit -v`` (8 GB, 64 GB) every reader failed with "Cannot allocate memory" on a 0.4 MiB log.
It now maps the file and room to grow (:func:`events.lmdbfile.reader_map_size`). Each reader
runs in a child process whose address space is limited to 4 GiB before it starts.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trainkit import loaders, small_net

from nnx_es.nnmodel import NNModel

REPO = Path(__file__).resolve().parents[2]
LIMIT = 4 << 30  # bytes of address space


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, preexec_fn=_limited, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "tests") + os.pathsep + str(REPO)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs root holding two small finished runs of 2 epochs, ``a`` and ``b``."""
    root = tmp_path_factory.mktemp("ulimit") / "runs"
    for run_id in ("a", "b"):
        NNModel(small_net()).train(*loaders(), epochs=2, runs_root=root, run_id=run_id, progress=False)
    return root


_IN_PROCESS = """
import sys
from pathlib import Path
from nnx_es.cli import inspect
from trainkit import loaders, small_net
from nnx_es.nnmodel import NNModel
root = Path(sys.argv[1])
for argv in ([str(root / "a")], [str(root / "a"), "--json"], [str(root / "a"), "--at", "10"], [str(root)],
             ["diff", str(root / "a"), str(root / "b")]):
    status = inspect.main(argv)
    assert status == 0, (argv, status)
for which in ("best", "last"):
    NNModel(small_net()).load(root / "a", which)
NNModel(small_net()).train(*loaders(), epochs=3, runs_root=root, resume_from=root / "b", progress=False)
print("all read")
"""


def test_every_reader_of_a_small_run_works_under_a_4_gib_address_space(runs: Path, tmp_path: Path):
    root = tmp_path / "runs"
    shutil.copytree(runs, root, ignore=shutil.ignore_patterns("lock.mdb"))
    for tool in (["tools/replay", str(root / "a")], ["tools/inspect", str(root / "a"), "summary"]):
        done = _run(*tool)
        assert done.returncode == 0, (tool, done.stderr)
        assert "Cannot allocate memory" not in done.stderr
    done = _run("-c", _IN_PROCESS, str(root))  # inspect events, --at, a runs root, diff; NNModel.load; a resume
    assert done.returncode == 0 and done.stdout.strip().endswith("all read"), done.stderr[-2000:]
