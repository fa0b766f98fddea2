"""Errors raised while loading and normalising training data.

Every error says what is wrong, where (file and line, or row index) and how to fix it, so a
notebook user can act on the message without reading a traceback.
"""

from __future__ import annotations

__all__ = ["FastftDataError", "MalformedRowError"]


class FastftDataError(ValueError):
    """Base class for data problems: bad source, unknown format, empty file, unreadable file."""


class MalformedRowError(FastftDataError):
    """One row of the input does not fit the expected format.

    Attributes:
        source: what the row came from as shown to the user (a file name, ``"list"``, a hub id...).
        line: 1-based physical line in the file (JSON Lines, CSV, or a JSON parse error), else None.
        row: 0-based row index (Parquet, JSON arrays, lists, ``datasets.Dataset``), else None.
        reason: what is wrong with the row, without the location.
        fix: the advice that ends the message.
    """

    def __init__(
        self,
        source: str,
        reason: str,
        *,
        line: int | None = None,
        row: int | None = None,
        fix: str = "Fix the row or drop it.",
    ) -> None:
        self.source = source
        self.line = line
        self.row = row
        self.reason = reason.rstrip(". ")
        self.fix = fix
        super().__init__(f"{self.location}: {self.reason}. {fix}".rstrip())

    @property
    def location(self) -> str:
        """Where the row is, e.g. ``"data.jsonl line 17"`` or ``"train.parquet row 3 (counting from 0)"``."""
        if self.line is not None:
            return f"{self.source} line {self.line}"
        if self.row is not None:
            return f"{self.source} row {self.row} (counting from 0)"
        return self.source

    def __reduce__(self):  # keep the error picklable (datasets may pickle exceptions across processes)
        return (_rebuild, (self.source, self.reason, self.line, self.row, self.fix))


def _rebuild(source: str, reason: str, line: int | None, row: int | None, fix: str) -> MalformedRowError:
    return MalformedRowError(source, reason, line=line, row=row, fix=fix)
