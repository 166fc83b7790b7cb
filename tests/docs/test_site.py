"""The documentation site builds in strict mode, with its generated reference and pictures.

``mkdocs build --strict`` fails on any warning: a broken link or anchor, a page missing from the
nav, a docstring reference mkdocstrings cannot resolve. One build (about 25 s of CPU on a loaded
2-core machine: a small real run for the pictures, mkdocstrings over the public API) serves every
test here (on one xdist worker: tests/conftest.py XDIST_GROUPS).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from snippets import REPO

ENV = {**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"}


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    built = _build(REPO / "mkdocs.yml", site)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-6000:]
    return site


@pytest.mark.slow
def test_the_site_builds_strict_with_every_event_kind_in_the_reference(site: Path) -> None:
    from events.codec import CURRENT_TYPES

    events = (site / "reference" / "events" / "index.html").read_text()
    for t in CURRENT_TYPES:  # every kind, with its fields
        assert f'id="{t.KIND}"' in events, t.KIND
        for field in t.__struct_fields__:
            assert f"<code>{field}</code>" in events, (t.KIND, field)


@pytest.mark.slow
def test_the_cli_reference_is_every_commands_help(site: Path) -> None:
    from nnx_es.cli.main import build_parser

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("crashtest", "init", "report", "run", "resume"):
        assert f"nnx-es {command}" in cli, command
    help_text = " ".join(build_parser().format_help().split())
    assert "nnx_es commands" in help_text and "nnx_es commands" in cli
    for flag in ("--schema", "--follow", "--hardest", "--verify", "--tensorboard"):  # nnx-inspect's
        assert flag in cli, flag


@pytest.mark.slow
def test_the_api_reference_renders_the_public_names_from_their_docstrings(site: Path) -> None:
    import nnx_es

    api = site / "reference" / "api"
    rendered = "".join(p.read_text() for p in api.rglob("index.html"))
    for name in nnx_es.__all__:
        assert f'id="{getattr(nnx_es, name).__module__}.{name}"' in rendered, name
    trainer = (api / "nnx_es.trainer" / "index.html").read_text()
    assert "Trains <code>net</code> and records every lifecycle transition" in trainer
    assert ":class:" not in trainer  # Sphinx roles are rewritten as code (docs/_gen/griffe_roles.py)


@pytest.mark.slow
def test_the_pictures_are_drawn_from_a_real_run(site: Path) -> None:
    for name in ("timeline", "commit-group", "cartography"):
        png = site / "assets" / "generated" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    assert "assets/generated/cartography.png" in (site / "guides" / "rows" / "index.html").read_text()


def test_a_guide_not_in_the_nav_joins_the_how_to_section() -> None:
    sys.path.insert(0, str(REPO / "docs" / "_gen"))
    from nav import GUIDES, on_config

    docs = REPO / "docs"
    config = {"docs_dir": str(docs), "nav": [{GUIDES: [{"Training options": "guides/training.md"}]},
                                             {"Reference": [{"Python API": ["reference/api/index.md"]}]}]}
    guides = on_config(config)["nav"][0][GUIDES]
    listed = [next(iter(e.values())) for e in guides]
    assert listed[0] == "guides/training.md" and listed.count("guides/training.md") == 1
    assert {p.relative_to(docs).as_posix() for p in (docs / "guides").glob("*.md")} == set(listed)
    assert {"Per-row records and cartography": "guides/rows.md"} in guides  # titled by its heading


def test_strict_mode_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The build the suite runs is strict: a planted broken link fails it (a bare site, no plugins: ~2 s)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# x\n\n[gone](missing.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: {tmp_path / 'docs'}\n")
    built = _build(config, tmp_path / "site")
    assert built.returncode != 0 and "missing.md" in built.stderr, built.stderr
