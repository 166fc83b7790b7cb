"""What ``inspect`` checks and describes beside reading the log: the JSON Schema of its
``--json`` lines, and whether a ``plot`` or ``export`` destination can be written as asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import msgspec

from events.codec import CURRENT_TYPES

__all__ = ["json_schema", "plot_format_error", "tensorboard_error"]


def json_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of one line of ``inspect RUN_DIR --json``, from the msgspec types.

    Each kind's object is what ``inspect --json`` prints (``nnx_es.cli.inspect``): ``seq`` (0-based), ``kind``
    (the stable kind name: the stored tag of version N > 1 is ``"<kind>@N"``,
    :mod:`events.schema`, but ``--json`` prints the name and the version apart),
    ``version`` and every field of the struct, defaulted ones too. Only today's
    versions occur: a legacy event is upcast when read (:func:`events.codec.decode`).
    A float that is not finite prints as ``null`` (msgspec's JSON has no NaN or
    infinity), so every number may be ``null``. ``$defs.Event`` is the union of
    the kinds, with an OpenAPI ``discriminator`` on ``kind``; ``$defs.Undecodable``
    is the line printed for a stored value that does not decode, ``$defs.Error`` the last line
    printed when inspect fails (a damaged log, an unusable input: ``{"error": {"type", "message"}}``).
    """
    (union,), defs = msgspec.json.schema_components([Union[CURRENT_TYPES]], ref_template="#/$defs/{name}")  # type: ignore[valid-type]
    seq = {"type": "integer", "minimum": 0, "description": "the event's position in the log (0-based)"}
    for node in defs.values():
        if "properties" in node:  # a struct: to_builtins prints every field
            node["required"], node["additionalProperties"] = list(node["properties"]), False
    for t in CURRENT_TYPES:
        node = defs[t.__name__]
        fields = {k: v for k, v in node["properties"].items() if k != "kind"}
        node["properties"] = {"seq": seq, "kind": {"const": t.KIND}, "version": {"const": t.VERSION}, **fields}
        node["required"] = list(node["properties"])
    _nullable_numbers(defs)
    defs["Event"] = {"anyOf": union["anyOf"], "discriminator": {
        "propertyName": "kind", "mapping": {t.KIND: f"#/$defs/{t.__name__}" for t in CURRENT_TYPES}}}
    defs["Undecodable"] = {
        "title": "Undecodable", "description": "A stored value that does not decode: its seq and why.",
        "type": "object", "properties": {"seq": seq, "kind": {"type": "null"}, "error": {"type": "string"}},
        "required": ["seq", "kind", "error"], "additionalProperties": False,
    }
    defs["Error"] = {
        "title": "Error", "description": "Why inspect stopped or failed (the last line; exit status 2).",
        "type": "object", "properties": {"error": {
            "type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"], "additionalProperties": False}},
        "required": ["error"], "additionalProperties": False,
    }
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "nnx_es inspect --json line",
            "anyOf": [{"$ref": "#/$defs/Event"}, {"$ref": "#/$defs/Undecodable"}, {"$ref": "#/$defs/Error"}],
            "$defs": defs}


def _nullable_numbers(node: Any) -> None:
    """Let every ``{"type": "number"}`` under ``node`` be null too (a non-finite float prints as null)."""
    if isinstance(node, dict):
        if node.get("type") == "number":
            node["type"] = ["number", "null"]
        for key, value in node.items():
            if key != "default":
                _nullable_numbers(value)
    elif isinstance(node, list):
        for value in node:
            _nullable_numbers(value)


def plot_format_error(out: Path) -> str | None:
    """Why matplotlib cannot write ``out`` (its extension names no format it writes), or None."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # the plot says matplotlib is missing
        return None
    known = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = out.suffix[1:].lower()
    if ext in known:
        return None
    what = f"its extension .{ext} names no image format matplotlib writes" if ext else "it has no extension"
    return f"argument --out: cannot plot to {str(out)!r}: {what}; use one of .{', .'.join(known)}"


def tensorboard_error(out_dir: Path) -> str | None:
    """Why exporting into ``out_dir`` would duplicate scalars (it holds event files already), or None."""
    try:
        found = sorted(p.name for p in out_dir.iterdir() if p.name.startswith("events.out.tfevents."))
    except OSError:  # missing (created by the export) or not a directory (the export says so)
        return None
    if not found:
        return None
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"argument --tensorboard: {str(out_dir)!r} already holds TensorBoard event files ({shown}); "
            "exporting again would show every scalar twice: choose an empty directory or delete them")
