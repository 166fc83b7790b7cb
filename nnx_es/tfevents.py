"""TensorBoard scalar event files, written a column of scalars at a time (numpy only).

A TensorBoard log directory holds ``events.out.tfevents.*`` files: TFRecord framing
(``uint64`` length, masked CRC-32C of the length, the data, masked CRC-32C of the data,
little-endian) around ``tensorflow.Event`` protocol buffers; the first record names
the file version ``brain.Event:2``. A scalar is an ``Event`` with ``wall_time``
(field 1, double), ``step`` (field 2, varint) and a ``Summary`` (field 5) holding one
``Summary.Value`` with ``tag`` (field 1) and ``simple_value`` (field 2, float32), what
``torch.utils.tensorboard.SummaryWriter.add_scalar`` writes.

That writer builds, frames and checksums each scalar in Python (its CRC-32C runs byte
by byte: tens of µs a scalar, minutes for the receipts of a long run). Here the scalars
of one tag are encoded into a ``uint8`` matrix, one record per row (rows grouped by the
byte length of their step), and the CRCs of every row are computed together, one byte
column at a time (table-driven CRC-32C, Castagnoli polynomial, as TFRecord specifies).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import numpy as np

__all__ = ["ScalarFileWriter"]

_POLY = 0x82F63B78  # CRC-32C, reflected


def _crc_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_TABLE = _crc_table()


def masked_crc32c(rows: np.ndarray) -> np.ndarray:
    """The masked CRC-32C of each row of ``rows`` (``uint8``, shape ``(n, length)``), as ``uint32`` (n,)."""
    crc = np.full(rows.shape[0], 0xFFFFFFFF, dtype=np.uint32)
    for j in range(rows.shape[1]):
        crc = _TABLE[(crc ^ rows[:, j]) & 0xFF] ^ (crc >> 8)
    crc ^= np.uint32(0xFFFFFFFF)
    return ((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)  # uint32 arithmetic wraps


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varint_bytes(values: np.ndarray) -> np.ndarray:
    """How many bytes the varint of each non-negative ``int64`` of ``values`` takes (1..9)."""
    size = np.ones(values.shape, dtype=np.int64)
    for k in range(1, 9):
        size += values >= (1 << (7 * k))
    return size


def _framed(data: np.ndarray) -> bytes:
    """TFRecords of the rows of ``data`` (``uint8`` (n, length), one record's data per row)."""
    n, length = data.shape
    header = struct.pack("<Q", length)
    header_crc = masked_crc32c(np.frombuffer(header, dtype=np.uint8)[None, :])[0]
    out = np.empty((n, 12 + length + 4), dtype=np.uint8)
    out[:, :8] = np.frombuffer(header, dtype=np.uint8)
    out[:, 8:12] = np.frombuffer(struct.pack("<I", int(header_crc)), dtype=np.uint8)
    out[:, 12 : 12 + length] = data
    out[:, 12 + length :] = masked_crc32c(data).astype("<u4")[:, None].view(np.uint8)
    return out.tobytes()


class ScalarFileWriter:
    """Append scalars to a new event file in ``log_dir`` (created when missing).

    Args:
        log_dir: the TensorBoard log directory.

    Raises:
        OSError: the directory or the file cannot be written.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.log_dir / f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        version = b"brain.Event:2"
        first = b"\x09" + struct.pack("<d", now) + b"\x1a" + _varint(len(version)) + version
        self._file.write(_framed(np.frombuffer(first, dtype=np.uint8)[None, :]))

    def add_scalars(self, tag: str, steps: np.ndarray, values: np.ndarray, wall_time: float | None = None) -> int:
        """Write one scalar record per ``(steps[i], values[i])`` under ``tag``; return how many.

        Args:
            tag: the scalar's name in TensorBoard.
            steps: the x of each scalar, non-negative integers (n,).
            values: the scalars (n,), stored as float32, as ``add_scalar`` does.
            wall_time: seconds since the epoch; now when not given.

        Raises:
            ValueError: a step is negative, or steps and values differ in length.
        """
        steps = np.asarray(steps, dtype=np.int64)
        values = np.asarray(values, dtype="<f4")
        if steps.shape != values.shape or steps.ndim != 1:
            raise ValueError(
                f"steps and values: expected two 1-D arrays of one length, got {steps.shape} and {values.shape}"
            )
        if steps.size and int(steps.min()) < 0:
            raise ValueError(f"steps: expected non-negative integers, got {int(steps.min())}")
        wall = struct.pack("<d", time.time() if wall_time is None else wall_time)
        name = tag.encode("utf-8")
        value = b"\x0a" + _varint(len(name)) + name + b"\x15"  # then the float32
        summary_value = b"\x0a" + _varint(len(value) + 4) + value
        summary = b"\x2a" + _varint(len(summary_value) + 4) + summary_value
        sizes = _varint_bytes(steps)
        for k in np.unique(sizes):
            k = int(k)
            which = sizes == k
            s, v = steps[which], values[which]
            head = b"\x09" + wall + b"\x10"
            data = np.empty((s.size, len(head) + k + len(summary) + 4), dtype=np.uint8)
            data[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
            for j in range(k):  # the step's varint, 7 bits a byte, low bits first
                data[:, len(head) + j] = ((s >> (7 * j)) & 0x7F) | (0x80 if j < k - 1 else 0)
            at = len(head) + k
            data[:, at : at + len(summary)] = np.frombuffer(summary, dtype=np.uint8)
            data[:, at + len(summary) :] = v[:, None].view(np.uint8)
            self._file.write(_framed(data))
        return int(steps.size)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ScalarFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
