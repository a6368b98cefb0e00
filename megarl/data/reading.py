"""Rows from .jsonl / .json / .parquet files, with malformed rows skipped and reported.

Each row keeps where it came from (file and line / item / row number), so every report and
error can point at it. Validation of a row's fields happens in the dataset, which knows the keys.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from megarl.config.errors import ConfigError


@dataclass
class BadRow:
    file: str
    where: str                                   # "line 7" (jsonl), "item 3" (json), "row 12" (parquet)
    reason: str

    def __str__(self) -> str:
        return f"{self.where} ({self.reason})"


@dataclass
class FileRows:
    path: str
    rows: list[tuple[str, dict]] = field(default_factory=list)   # (where, row)
    bad: list[BadRow] = field(default_factory=list)
    total: int = 0


def read_rows(path: str, key: str = "data.train_files") -> FileRows:
    if not os.path.isfile(path):
        raise ConfigError(f"data file not found: {path}", key)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        return _read_parquet(path)
    if ext in (".jsonl", ".json"):
        # surrogateescape: a row with bytes that are not UTF-8 is named and skipped, not the whole file refused
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
        if ext == ".json" and text.lstrip().startswith("["):
            return _read_json_array(path, text)
        return _read_jsonl(path, text)
    raise ConfigError(f"{path}: unsupported file type {ext or '(none)'}; use .jsonl, .json or .parquet", key)


def _read_jsonl(path: str, text: str) -> FileRows:
    out = FileRows(path)
    # Only "\n" ends a row: str.splitlines() also splits at U+2028/U+2029/U+0085, which
    # json.dumps(ensure_ascii=False) writes raw inside strings, and would break valid rows in two.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        out.total += 1
        where = f"line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            out.bad.append(BadRow(path, where, f"bad JSON: {err.msg}"))
            continue
        except RecursionError:        # a ground_truth nested 100,000 deep: this row, not the run
            out.bad.append(BadRow(path, where, f"nested too deeply to parse (over {sys.getrecursionlimit()} levels)"))
            continue
        problem = _not_encodable(line, row)
        if problem:
            out.bad.append(BadRow(path, where, problem))
            continue
        _add(out, where, row)
    return out


def _not_encodable(line: str, row: Any) -> str | None:
    """Bytes that are not UTF-8 (read with surrogateescape), or a lone UTF-16 surrogate written as a
    JSON escape (\\ud800): json.loads takes both, but the tokenizer and every writer refuse them later,
    far from the row. The row is named here and skipped like a malformed one."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"bytes that are not UTF-8 at character {err.start + 1}; re-save the file as UTF-8"
    stack = [row]
    while stack:                      # iterative: the row may nest up to the parser's own limit
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                return (f"a lone UTF-16 surrogate \\u{ord(value[err.start]):04x} in the string {value[:40]!r}, which "
                        "is no character; fix the writer (or drop the row)")
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return None


def _read_json_array(path: str, text: str) -> FileRows:
    out = FileRows(path)
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON (line {err.lineno}: {err.msg}); fix the file or write it as .jsonl "
                         "so single bad lines can be skipped") from None
    for number, row in enumerate(items, start=1):
        out.total += 1
        _add(out, f"item {number}", row)
    return out


def _read_parquet(path: str) -> FileRows:
    import pyarrow.parquet as pq  # optional at run time: only for .parquet files (a second to load)
    out = FileRows(path)
    try:
        table = pq.read_table(path)
    except Exception as err:
        raise ValueError(f"{path}: cannot read parquet ({type(err).__name__}: {err})") from None
    number = 0
    for batch in table.to_batches():
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:     # a string column holds bytes that are not UTF-8: found row by row
            rows = [_parquet_row(batch, i) for i in range(batch.num_rows)]
        for row in rows:
            number += 1
            out.total += 1
            if isinstance(row, BadRow):
                out.bad.append(BadRow(path, f"row {number}", row.reason))
            else:
                _add(out, f"row {number}", row)
    return out


def _parquet_row(batch, i: int) -> dict | BadRow:
    """Row `i` of a record batch, or why it cannot be read (as JSONL names a line that is not UTF-8)."""
    row = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            row[name] = column[i].as_py()
        except UnicodeDecodeError as err:
            return BadRow("", "", f"bytes that are not UTF-8 in column '{name}' at byte {err.start + 1}; re-save "
                                  "the file with UTF-8 strings")
    return row


def _add(out: FileRows, where: str, row: Any) -> None:
    if not isinstance(row, dict):
        out.bad.append(BadRow(out.path, where, f"not an object but {type(row).__name__}"))
    else:
        out.rows.append((where, row))
