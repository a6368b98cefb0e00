"""Rows from .jsonl / .json / .parquet files, with malformed rows skipped and reported.

Each row keeps where it came from (file and line / item / row number), so every report and
error can point at it. Validation of a row's fields happens in the dataset, which knows the keys.
"""
from __future__ import annotations

import json
import os
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
        with open(path, encoding="utf-8") as f:
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
        _add(out, where, row)
    return out


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
    for number, row in enumerate(table.to_pylist(), start=1):
        out.total += 1
        _add(out, f"row {number}", row)
    return out


def _add(out: FileRows, where: str, row: Any) -> None:
    if not isinstance(row, dict):
        out.bad.append(BadRow(out.path, where, f"not an object but {type(row).__name__}"))
    else:
        out.rows.append((where, row))
