"""A parquet file whose string column holds bytes that are not UTF-8 in some rows: each such row is
named (file, row, column) and skipped, as a JSONL line that is not UTF-8 is, instead of the whole
file refused by a UnicodeDecodeError naming neither; --check's readers of the first row and of the
data sources pass over it. Real pyarrow files, megarl's real readers.

    python -m pytest -q tests/faults/test_parquet_bytes.py
"""
from __future__ import annotations

import json

import pytest

from megarl.data.reading import read_rows
from megarl.launcher.preflight_run import _first_of_each, check_columns

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def strings(values: list[bytes]):
    """A string column holding exactly these bytes (pyarrow checks nothing when given buffers)."""
    raw = pa.array(values, type=pa.binary())
    return pa.Array.from_buffers(pa.string(), len(values), raw.buffers())


def test_rows_with_bytes_that_are_not_utf8_are_named_and_skipped(tmp_path):
    path = tmp_path / "train.parquet"
    prompts = [json.dumps([{"role": "user", "content": f"{i}+1="}]).encode() for i in range(5)]
    prompts[1] = b"caf\xe9 1+1="
    sources = [b"addition"] * 5
    sources[3] = b"addi\xfftion"
    pq.write_table(pa.table({"prompt": strings(prompts), "data_source": strings(sources)}), path)

    got = read_rows(str(path))
    assert got.total == 5 and [where for where, _ in got.rows] == ["row 1", "row 3", "row 5"]
    assert [f"{b.file}: {b}" for b in got.bad] == [
        f"{path}: row 2 (bytes that are not UTF-8 in column 'prompt' at byte 4; re-save the file with UTF-8 strings)",
        f"{path}: row 4 (bytes that are not UTF-8 in column 'data_source' at byte 5; re-save the file with UTF-8 "
        "strings)"]
    assert got.rows[1][1]["data_source"] == "addition"
    assert _first_of_each(str(path), "data_source") == {"addition": "row 1"}


def test_a_first_row_that_is_not_utf8_leaves_the_column_check_to_the_dataset(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": strings([b"\xff\xfe", b"1+1="])}), path)
    check_columns(str(path), "data.train_files", "prompt")       # no UnicodeDecodeError
    assert [where for where, _ in read_rows(str(path)).rows] == ["row 2"]
