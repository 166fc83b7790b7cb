"""Generates the reference pages at build time (mkdocs-gen-files), from the code itself:

* ``reference/api/*.md``: the Python API, one page per module (``api_pages``), rendered from
  the docstrings by mkdocstrings;
* ``reference/cli.md``: every command's ``--help``, from the argparse parsers
  (``nnx_es.cli.main.build_parser``, ``nnx_es.cli.inspect.build_parser``,
  ``nnx_es.cli.replay.build_parser``), sub-commands included;
* ``reference/events.md``: every event kind of ``events.codec.CURRENT_TYPES`` with its fields,
  their types, defaults and meaning (the docstrings and ``#:`` comments of ``events/schema.py`` and the modules it re-exports),
  the value types they carry, and the lifecycle order (``nnx_es.lifecycle``).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_pages import api_pages  # noqa: E402

# --- the Python API --------------------------------------------------------------------------

for page in api_pages():
    with mkdocs_gen_files.open(page.path, "w") as f:
        f.write(f"# `{page.module}`\n\n")
        f.write(f"::: {page.module}\n    options:\n      show_root_heading: false\n      members:\n")
        f.writelines(f"        - {name}\n" for name in page.members)


# --- the command line ------------------------------------------------------------------------


def _help(parser: argparse.ArgumentParser) -> str:
    os.environ["COLUMNS"] = "100"  # the same width on every machine
    return parser.format_help()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:  # argparse keeps its sub-parsers there (no public accessor)
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
    return subs


def _command(f, title: str, parser: argparse.ArgumentParser, intro: str) -> None:
    f.write(f"## {title}\n\n{intro}\n\n```text\n{_help(parser)}```\n\n")
    for name, sub in _subcommands(parser).items():
        f.write(f"### {title} {name}\n\n```text\n{_help(sub)}```\n\n")


from nnx_es.cli import inspect as inspect_cli  # noqa: E402
from nnx_es.cli import main as main_cli  # noqa: E402
from nnx_es.cli import replay as replay_cli  # noqa: E402

with mkdocs_gen_files.open("reference/cli.md", "w") as f:
    f.write(
        "# Command line\n\nGenerated from the commands' own argument parsers when the site is built, so it is\n"
        "what `--help` prints. Exit status everywhere: 0 success, 1 a failure the command reports\n"
        "(violations, a failed run, a difference), 2 unusable input (one line on stderr naming it).\n\n"
    )
    _command(f, "nnx-es", main_cli.build_parser(),
             "Train from a spec, resume, crash-test a script (also `python -m nnx_es`). "
             "Guides: [Recipes and the CLI](../guides/recipes-cli.md), "
             "[Crash-test your own code](../guides/crash-testing.md).")
    _command(f, "nnx-inspect", inspect_cli.build_parser(),
             "Read a run, a runs root or two runs (`tools/inspect` in a checkout). "
             "Guide: [Inspect and audit runs](../guides/inspect.md).")
    _command(f, "nnx-replay", replay_cli.build_parser(),
             "Audit a run against the invariants of [INVARIANTS.md](../INVARIANTS.md) "
             "(`tools/replay` in a checkout).")


# --- the events ------------------------------------------------------------------------------

import events.schema  # noqa: E402
import events.values  # noqa: E402
from events.codec import CURRENT_TYPES  # noqa: E402
from nnx_es import lifecycle  # noqa: E402
from projections.commits import GROUP_KINDS  # noqa: E402


def _fields(module) -> dict[str, list[tuple[str, str, str, str]]]:
    """class name -> [(field, annotation, default, comment)] from the module's source."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    found: dict[str, list[tuple[str, str, str, str]]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        rows = []
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            annotation = ast.unparse(stmt.annotation)
            if annotation.startswith("ClassVar"):
                continue
            comment = []
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):  # "#:" lines above the field
                comment.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            tail = lines[stmt.lineno - 1].split("  # ", 1)  # a comment after the field
            if len(tail) == 2:
                comment.append(tail[1].strip())
            default = ast.unparse(stmt.value) if stmt.value is not None else "required"
            rows.append((stmt.target.id, annotation, default, " ".join(comment)))
        found[node.name] = rows
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(cls) -> str:
    return inspect.cleandoc(cls.__doc__) if cls.__doc__ and cls.__doc__ != events.schema.Event.__doc__ else ""


def _table(f, rows) -> None:
    if not rows:
        f.write("No fields.\n\n")
        return
    f.write("| field | type | default | meaning |\n|---|---|---|---|\n")
    for name, annotation, default, comment in rows:
        f.write(f"| `{name}` | `{_cell(annotation)}` | `{_cell(default)}` | {_cell(comment)} |\n")
    f.write("\n")


# the events live in events/schema.py and the modules it re-exports (commit_events, model_events)
event_fields = {name: rows for module in sorted({sys.modules[t.__module__] for t in CURRENT_TYPES}, key=str)
                for name, rows in _fields(module).items()}
value_fields = _fields(events.values)

with mkdocs_gen_files.open("reference/events.md", "w") as f:
    f.write(
        "# Events\n\nEvery kind of event a run's log holds, generated from `events/schema.py` when the site is\n"
        "built: the fields with their types and defaults (a field with a default may be missing from\n"
        "an older run's events: it decodes to the default) and what they mean. Each kind has a stable\n"
        "tag; version N > 1 of a kind is stored as `kind@N` and older versions are upcast when read.\n"
        "`nnx-inspect RUN --json` prints events with these fields; `nnx-inspect --schema` gives their\n"
        "JSON Schema. [The lifecycle and its events](../concepts/lifecycle.md) tells the story.\n\n"
        "## The order of a run\n\nDeclared in `nnx_es.lifecycle` (the machine the runtime and the audit both use):\n\n"
        f"```text\n{lifecycle.__doc__.split('::', 1)[1].strip(chr(10))}\n```\n\n"
        "Kinds in an epoch's *commit group* (made durable by one synced write, with its `last_committed`): "
        + ", ".join(f"`{k}`" for k in sorted(GROUP_KINDS)) + ".\n\n## Kinds\n\n"
        "| kind | version | what it records |\n|---|---|---|\n"
    )
    for t in CURRENT_TYPES:
        first = (_doc(t).split("\n\n")[0].replace("\n", " ") or "-")
        f.write(f"| [`{t.KIND}`](#{t.KIND}) | {t.VERSION} | {_cell(first)} |\n")
    f.write("\n")
    for t in CURRENT_TYPES:
        f.write(f"### `{t.KIND}` {{#{t.KIND}}}\n\n`events.schema.{t.__name__}`, version {t.VERSION}.\n\n")
        doc = _doc(t)
        if doc:
            f.write(f"{doc}\n\n")
        _table(f, event_fields.get(t.__name__, []))
    f.write("## Value types\n\nStructs the events carry (`events/values.py`).\n\n")
    for name in events.values.__all__:
        cls = getattr(events.values, name)
        f.write(f"### `{name}` {{#{name.lower()}}}\n\n")
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc:
            f.write(f"{doc}\n\n")
        _table(f, value_fields.get(name, []))
