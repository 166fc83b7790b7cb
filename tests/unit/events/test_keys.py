"""events.keys: the stored keys are 0, 1, 2, ... in stored order, or the first key out of place is named."""

from __future__ import annotations

import pytest

import events.keys
from events.errors import SequenceGapError
from events.keys import check_keys
from events.log import seq_key


def _keys(seqs: list[int]) -> list[bytes]:
    return [seq_key(s) for s in seqs]


@pytest.fixture(params=[1 << 16, 1, 2, 3, 5], ids=lambda b: f"block {b}")
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every case in one block and split across blocks (a problem at a block's end sees the next key)."""
    monkeypatch.setattr(events.keys, "_BLOCK", request.param)
    return int(request.param)


def test_keys_in_order_are_counted(block: int) -> None:
    assert check_keys(iter([])) == 0
    assert check_keys(iter(_keys(list(range(11))))) == 11


CASES = {
    # name -> (stored keys, kind, expected, found, message)
    "changed to the next key": ([0, 1, 3, 3, 4], "changed", 2, 3,
                                "changed key: key 3 follows key 1 and precedes key 3, in the place of seq 2"),
    "changed to an earlier key": ([0, 1, 2, 0, 4], "changed", 3, 0,
                                  "changed key: key 0 follows key 2 and precedes key 4, in the place of seq 3"),
    "the first key changed": ([8, 1, 2], "changed", 0, 8,
                              "changed key: the first key is 8 and precedes key 1, in the place of seq 0"),
    "a deleted key": ([0, 1, 2, 4, 5], "gap", 3, 4,
                      "sequence gap: expected seq 3, found seq 4 (key 4 follows key 2; seq 3 is missing)"),
    "deleted keys at the start": ([3, 4], "gap", 0, 3,
                                  "sequence gap: expected seq 0, found seq 3 (the first key is 3; seqs 0..2 are missing)"),
    "the last key changed": ([0, 1, 2, 9], "gap", 3, 9,
                             "sequence gap: expected seq 3, found seq 9 (key 9 follows key 2; seqs 3..8 are missing)"),
    "a duplicate": ([0, 1, 2, 2, 2, 5], "duplicate", 3, 2, "duplicate key: key 2 follows key 2 (expected seq 3)"),
    "a key out of order": ([0, 1, 2, 3, 1, 0, 6], "out of order", 4, 1,
                           "key out of order: key 1 follows key 3 (expected seq 4)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_first_key_out_of_place_is_named(name: str, block: int) -> None:
    seqs, kind, expected, found, message = CASES[name]
    with pytest.raises(SequenceGapError) as info:
        check_keys(iter(_keys(seqs)))
    assert (info.value.kind, info.value.expected, info.value.found) == (kind, expected, found)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_a_key_of_another_length_is_malformed() -> None:
    with pytest.raises(SequenceGapError, match="malformed key: the key in the place of seq 3 is not 8 bytes long"):
        check_keys(iter([seq_key(0), seq_key(1), seq_key(2), b"\x00\x03", seq_key(4)]))


def test_keys_from_a_first_seq_on_are_checked_against_it(block: int) -> None:
    assert check_keys(iter(_keys(list(range(5, 11)))), 5) == 6
    with pytest.raises(SequenceGapError) as info:
        check_keys(iter(_keys([5, 6, 8])), 5)
    assert (info.value.expected, info.value.found) == (7, 8)


def test_a_log_checks_the_keys_of_a_range_only(tmp_path) -> None:
    from events.log import LmdbLog
    from events.schema import EpochBegan

    with LmdbLog(tmp_path / "l") as log:
        for e in range(10):
            log.append(EpochBegan(epoch=e))
        log.flush()
        log.delete_raw(2)  # a gap at seq 2
        assert log.check_keys(3) == 7 and log.check_keys(4, 8) == 4
        with pytest.raises(SequenceGapError, match="expected seq 2"):
            log.check_keys(0, 5)
        with pytest.raises(SequenceGapError, match="expected seq 2"):
            log.check_keys(2)
