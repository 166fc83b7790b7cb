"""The snippet runner (tests/docs/snippets.py) fails a page whose block fails, and keeps the convention."""

from __future__ import annotations

from pathlib import Path

import pytest

from snippets import SnippetError, blocks, pages

PLANTED = '''# A page

```bash
echo "from bash" > note.txt
```

```python title="helper.py"
VALUE = 41
```

```python
from helper import VALUE       # the titled block is a file of the page's directory
import os, sys
text = open("note.txt").read().strip()
assert os.environ["PATH"].split(os.pathsep)[0].endswith("bin")
assert __name__ == "__main__"
answer = VALUE + 1
```

<!-- skip: planted, must never run -->
```python
raise SystemExit("a skipped block ran")
```

```text
this is output, not code
```

```python
assert answer == 42 and text == "from bash"   # the namespace and the directory carry over
print("reached the planted break")
open("before.txt", "w").write("ran")
{broken}
open("after.txt", "w").write("ran")
```

```bash
echo "never reached" > after_bash.txt
```
'''


def _page(tmp_path: Path, broken: str) -> Path:
    page = tmp_path / "planted.md"
    page.write_text(PLANTED.replace("{broken}", broken))
    return page


def test_a_page_whose_blocks_all_run_passes(tmp_path: Path, page_runner) -> None:
    out = page_runner.check(_page(tmp_path, "pass"), tmp_path / "work")
    assert "reached the planted break" in out
    assert (tmp_path / "work" / "after.txt").exists() and (tmp_path / "work" / "after_bash.txt").exists()


def test_a_planted_broken_python_block_fails_the_page_naming_its_line(tmp_path: Path, page_runner) -> None:
    page = _page(tmp_path, "undefined_name + 1")
    with pytest.raises(SnippetError) as failed:
        page_runner.check(page, tmp_path / "work")
    line = PLANTED.splitlines().index("{broken}") + 1
    assert f'planted.md", line {line}' in str(failed.value), str(failed.value)   # the traceback names the page's line
    assert "NameError" in str(failed.value)
    work = tmp_path / "work"
    assert (work / "before.txt").exists() and not (work / "after.txt").exists() and not (work / "after_bash.txt").exists()


def test_a_failing_shell_command_fails_its_block(tmp_path: Path, page_runner) -> None:
    page = tmp_path / "shell.md"
    page.write_text("# s\n\n```bash\nfalse\necho 'not reached' > later.txt\n```\n")
    with pytest.raises(SnippetError, match="shell block at .*shell.md:3 exited 1"):
        page_runner.check(page, tmp_path / "work")
    assert not (tmp_path / "work" / "later.txt").exists()


def test_a_page_outrunning_its_time_is_stopped(tmp_path: Path, page_runner) -> None:
    page = tmp_path / "slow.md"
    page.write_text("# s\n\n```python\nimport time\ntime.sleep(60)\n```\n")
    with pytest.raises(SnippetError, match="took more than 2 s"):
        page_runner.check(page, tmp_path / "work", timeout_s=2)
    assert "ok" in page_runner.check(_page(tmp_path, "print('ok')"), tmp_path / "again")  # the runner goes on


def test_a_skip_without_a_reason_and_an_unclosed_fence_are_refused(tmp_path: Path) -> None:
    page = tmp_path / "bad.md"
    page.write_text("# b\n\n<!-- skip -->\n```python\npass\n```\n")
    with pytest.raises(SnippetError, match="needs a reason"):
        blocks(page)
    page.write_text("# b\n\n```python\npass\n")
    with pytest.raises(SnippetError, match="never closed"):
        blocks(page)
    page.write_text('# b\n\n```python title="../escape.py"\npass\n```\n')
    with pytest.raises(SnippetError, match="inside the page's directory"):
        blocks(page)


def test_blocks_reads_languages_skips_and_files(tmp_path: Path) -> None:
    found = blocks(_page(tmp_path, "pass"))
    assert [(b.lang, b.runs, b.file) for b in found] == [
        ("bash", True, None), ("python", False, "helper.py"), ("python", True, None), ("python", False, None),
        ("text", False, None), ("python", True, None), ("bash", True, None)]
    assert found[3].skip == "planted, must never run"


def test_pages_are_found_not_listed(tmp_path: Path) -> None:
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# r\n")
    (tmp_path / "docs" / "index.md").write_text("# i\n")
    (tmp_path / "docs" / "guides" / "new-topic.md").write_text("# n\n")
    assert [p.relative_to(tmp_path).as_posix() for p in pages(tmp_path)] == [
        "README.md", "docs/guides/new-topic.md", "docs/index.md"]


def test_a_shell_blocks_nnx_es_runs_in_a_warm_child_with_the_shells_arguments_status_pipes_and_signals(
        tmp_path: Path, page_runner) -> None:
    """``nnx-es`` in a shell block is warmkit's shim: the command's output goes through the shell's pipe, its
    exit status and a kill by signal (NNX_ES_KILL_AT: SIGKILL, ``$?`` 137) are the shell's, as the installed
    script's would be."""
    page = tmp_path / "cli.md"
    page.write_text('# c\n\n```bash\n'
                    'command -v nnx-es > which.txt\n'
                    'nnx-es init --out s.json --epochs 1 | head -1 > init.txt\n'
                    'nnx-es --no-such-option 2> err.txt || echo "$?" > bad.txt\n'
                    'NNX_ES_KILL_AT=event:3 nnx-es run s.json --run-id r || echo "$?" > killed.txt\n'
                    '```\n')
    page_runner.check(page, tmp_path / "work")
    work = tmp_path / "work"
    assert "nnx-shims-" in (work / "which.txt").read_text()
    assert (work / "init.txt").read_text().startswith("wrote s.json: mlp on digits, 1 epochs")
    assert (work / "bad.txt").read_text().strip() == "2" and "required: COMMAND" in (work / "err.txt").read_text()
    assert (work / "killed.txt").read_text().strip() == "137"
    assert len(list((work / "runs" / "r" / "events.lmdb").iterdir())) >= 1  # killed mid-run, not refused at once
