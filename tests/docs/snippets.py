"""The documentation's code blocks, run as a reader would run them.

The convention (docs/contributing.md, "Writing a docs page"):

* every fenced ```` ```python ```` (or ``py``) and ```` ```bash ```` (or ``sh``, ``shell``) block of
  README.md and of every page under ``docs/`` is executed, in page order;
* a page runs in a fresh temporary working directory, with the repository's ``.venv/bin`` first on
  ``PATH`` (after the warm ``nnx-es``: see the shell blocks) and the repository root on ``PYTHONPATH``;
* the Python blocks of one page share one namespace (a page builds on its earlier blocks, as a
  reader's session would), run in one process whose ``__name__`` is ``"__main__"``; each shell
  block is its own ``bash -e -o pipefail`` (its ``cd`` and ``export`` end with it; the working
  directory and its files are the page's); its ``nnx-es`` runs in a child of the warm process
  (``warmserver.shim``: the installed command's function, with the shell's arguments, directory,
  environment and descriptors; its exit status or signal is the shell's);
* a block preceded, on the line just above its fence, by ``<!-- skip: reason -->`` is not run
  (the reason is required); ```` ```text ```` and every other language are output or data, never run;
* a block with a file name, ```` ```python title="train.py" ```` (any language; Material shows the
  name above the block), is that file: it is written to the page's directory, not run, for a
  later block to use (``python train.py``).

``python tests/docs/snippets.py PAGE.md [PAGE.md ...]`` runs pages by hand (each in a fresh
temporary directory); the suite runs every page through :class:`PageRunner`
(tests/docs/test_snippets.py). A failing block is named ``page:line`` in the traceback (Python
blocks are compiled with the page's own line numbers) or in the runner's message (shell blocks).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # tests/: the warm process (warmkit)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from warmkit import Warm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "shell"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_TITLE = re.compile(r'title="([^"]+)"')
_SKIP = re.compile(r"^\s*<!--\s*skip\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")

#: seconds one page may take before the suite calls it hung
PAGE_TIMEOUT_S = 600


class SnippetError(AssertionError):
    """A page's block failed, or the page is not well formed (an unclosed fence, a skip without a reason)."""


@dataclass(frozen=True)
class Block:
    """One fenced block: ``line`` is the 1-based line of its opening fence in ``page``."""

    page: Path
    line: int
    lang: str
    code: str
    skip: str | None  # the reason given by ``<!-- skip: reason -->`` on the line above, else None
    file: str | None = None  # ``title="name"``: the block is this file of the page's directory

    @property
    def runs(self) -> bool:
        return self.skip is None and self.file is None and (self.lang in PYTHON or self.lang in SHELL)

    @property
    def where(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> str:
    try:
        return str(page.resolve().relative_to(REPO))
    except ValueError:
        return str(page)


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order. Raises :class:`SnippetError` for an unclosed fence
    or a ``<!-- skip -->`` without a reason (naming the page and line)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        lang = (m["info"].split() or [""])[0].lower().lstrip("{.")
        title = _TITLE.search(m["info"])
        file = title.group(1) if title else None
        if file is not None and (Path(file).is_absolute() or ".." in Path(file).parts):
            raise SnippetError(f"{_shown(page)}:{i + 1}: title={file!r} must name a file inside the page's directory")
        skip = None
        if i > 0 and (s := _SKIP.match(lines[i - 1])) is not None:
            skip = (s["reason"] or "").strip()
            if not skip:
                raise SnippetError(f"{_shown(page)}:{i}: <!-- skip --> needs a reason: <!-- skip: why it is not run -->")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not _closes(lines[i], fence):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        if i == len(lines):
            raise SnippetError(f"{_shown(page)}:{start + 1}: the {fence}{lang} block is never closed")
        found.append(Block(page, start + 1, lang, "\n".join(body) + "\n", skip, file))
        i += 1
    return found


def _closes(line: str, fence: str) -> bool:
    s = line.strip()
    return len(s) >= len(fence) and set(s) == {fence[0]}


def pages(root: Path = REPO) -> list[Path]:
    """README.md and every Markdown page under ``docs/`` (found, not listed: a new page is picked up)."""
    found = [root / "README.md"] if (root / "README.md").exists() else []
    found += sorted(p for p in (root / "docs").rglob("*.md") if not any(part.startswith(".") for part in p.parts))
    return found


def environment(repo: Path = REPO) -> dict[str, str]:
    """The environment a page runs in: the repository's ``.venv/bin`` (else this interpreter's
    directory) first on ``PATH``, the repository root first on ``PYTHONPATH``."""
    env = dict(os.environ)
    venv_bin = repo / ".venv" / "bin"
    bin_dir = venv_bin if (venv_bin / "python").exists() else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(repo), env.get("PYTHONPATH", "")] if p)
    env.pop("NNX_ES_KILL_AT", None)  # a page that kills a run sets it on its own command
    env["MPLBACKEND"] = "Agg"
    env.pop("PYTEST_ADDOPTS", None)  # a page that runs pytest runs it as a reader would
    return env


class PageRunner:
    """Runs pages, each in a child forked from a warm process (``tests/warmkit.py``).

    The warm process imports what pages commonly import (``warmserver.PRELOAD``) once and never runs
    a tensor op itself, so a forked child starts with no thread pool to inherit. Each child enters
    its page's working directory, sends its output to a log file and runs the blocks
    (:func:`run_blocks`) with a fresh ``__main__``: what a page does stays in its child. ``warm``:
    a warm process to share (the suite's, ``warmkit.shared()``); by default one of its own, started
    with the pages' interpreter.
    """

    def __init__(self, warm: Warm | None = None) -> None:
        env = environment()
        self._own = warm is None
        self._warm = Warm(Path(env["PATH"].split(os.pathsep)[0]) / "python", env) if warm is None else warm

    def check(self, page: Path, workdir: Path, timeout_s: float = PAGE_TIMEOUT_S) -> str:
        """Run every runnable block of ``page`` in ``workdir``, in order; return the output.

        Raises :class:`SnippetError` naming the failing block (page:line) with the output when a
        block fails, when the page is malformed, or when the page outruns ``timeout_s`` (its
        processes are then killed).
        """
        blocks(page)  # a malformed page is refused here, before anything runs
        workdir.mkdir(parents=True, exist_ok=True)
        log = workdir.parent / f"{workdir.name}.snippets.log"
        rc = self._warm.run(f"file:{Path(__file__).resolve()}:run_page", [str(page.resolve())], cwd=workdir.resolve(),
                            env=self._warm.shim_env(environment()), stdout=log, timeout_s=timeout_s)
        output = log.read_text(errors="replace") if log.exists() else ""
        if rc is None:
            raise SnippetError(f"{_shown(page)} took more than {timeout_s} s\n{output[-6000:]}")
        if rc != 0:
            raise SnippetError(f"{_shown(page)}: a block failed (exit {rc})\n{output[-8000:]}")
        return output

    def close(self) -> None:
        if self._own:
            self._warm.close()


def run_page(args: list[str]) -> int:
    """The job of a page's child (in its working directory, output on the log): run the page's blocks."""
    sys.argv = [args[0]]
    return run_blocks(Path(args[0]))


# --- the child: runs one page's blocks in order, in its working directory --------------------


def run_blocks(page: Path) -> int:
    """Run ``page``'s blocks here (the current directory is the page's); 0 when every one ran."""
    main = types.ModuleType("__main__")  # the page's namespace, importable as __main__ (pickle by reference)
    sys.modules["__main__"] = main
    for block in blocks(page):
        if block.file is not None and block.skip is None:
            Path(block.file).parent.mkdir(parents=True, exist_ok=True)
            Path(block.file).write_text(block.code)
            continue
        if not block.runs:
            continue
        print(f"--- {block.where} ({block.lang})", flush=True)
        t0 = time.perf_counter()
        if block.lang in PYTHON:
            code = compile("\n" * (block.line) + block.code, _shown(page), "exec")  # tracebacks give page lines
            try:
                exec(code, main.__dict__)  # noqa: S102 - the documentation's own code, run as its reader would
            except BaseException:  # noqa: BLE001 - report any failure with its traceback, then stop
                import traceback

                sys.stdout.flush()
                traceback.print_exc()
                print(f"FAILED: the python block at {block.where}", file=sys.stderr)
                return 1
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            rc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code]).returncode
            if rc != 0:
                print(f"FAILED: the shell block at {block.where} exited {rc}", file=sys.stderr)
                return 1
        print(f"    ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


def _main(argv: list[str]) -> int:
    runner = PageRunner()
    status = 0
    try:
        for name in argv:
            with tempfile.TemporaryDirectory(prefix="nnx-docs-") as tmp:
                t0 = time.perf_counter()
                try:
                    out = runner.check(Path(name), Path(tmp) / "page")
                except SnippetError as exc:
                    print(exc)
                    status = 1
                else:
                    print(out, end="")
                    print(f"{name}: every block ran ({time.perf_counter() - t0:.1f} s)")
    finally:
        runner.close()
    return status


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
