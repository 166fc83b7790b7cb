"""``make bench`` rewrites only its generated sections of BENCHMARKS.md."""

from __future__ import annotations

from bench.markdown import HEADER, write_section


def test_a_generated_section_is_replaced_in_place_and_the_hand_written_text_survives(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(path, "bench.run", "table one")
    path.write_text(path.read_text() + "\n## Hand-written notes\n\nkept\n")
    write_section(path, "bench.ddp", "ddp table")
    write_section(path, "bench.run", "table two")
    text = path.read_text()
    assert text.startswith(HEADER)
    assert "table one" not in text and text.count("table two") == 1 and text.count("ddp table") == 1
    assert text.index("table two") < text.index("## Hand-written notes") < text.index("ddp table")
    assert "kept" in text
