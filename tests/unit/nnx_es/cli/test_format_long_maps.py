"""inspect's text rendering of long maps and lists (``--at`` of a long run's stored checkpoints)."""

from __future__ import annotations

import hashlib

import msgspec

from nnx_es.cli._format import MAX_SHOWN, fmt
from projections.checkpoints import CheckpointsState


def test_a_long_runs_stored_checkpoints_print_their_ends_and_a_count_not_every_entry():
    names = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(1941)]
    state = CheckpointsState(commits=1941, stored={m: i for i, m in enumerate(names)})
    line = fmt(state)
    assert "... 1935 more (1941 in all; --json prints every one) ..." in line
    assert f"{names[0][:12]}: 0" in line and f"{names[-1][:12]}: 1940" in line and names[5][:12] not in line
    assert len(line) < 600
    assert len(msgspec.to_builtins(state)["stored"]) == 1941  # --json (to_builtins) keeps every entry


def test_short_maps_and_lists_print_whole():
    assert fmt(list(range(MAX_SHOWN))) == "[" + ", ".join(map(str, range(MAX_SHOWN))) + "]"
    assert fmt({"a": 1.0, "b": [1, 2]}) == "{a: 1, b: [1, 2]}"
    assert fmt(list(range(MAX_SHOWN + 1))).count(",") == 6  # 4 + the count + 2
