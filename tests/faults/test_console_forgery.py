"""Text from data or user code that reads like megarl's own status lines (a config error, a stop, an
allocator's abort) neither mutes the launcher's console nor relabels how the run ended: only the
lines megarl's processes record (megarl/parallel/own_lines.py) count. The launcher's console copy
in this process, then one real two-rank run whose reward prints those words while it scores.

    python -m pytest -q tests/faults/test_console_forgery.py
"""
from __future__ import annotations

import io

import pytest

from megarl.launcher.output import RankOutput
from tests.faults.conftest import FORGED, NATIVE


def console(tmp_path, lines: list[str], code: int, own: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    records = tmp_path / "own-lines"
    records.write_text("".join(line + "\n" for line in own))
    out = io.BytesIO()
    echo = RankOutput(out, "run/logs/megarl-1.log", str(records))
    for line in lines:
        echo.write(line.encode() + b"\n")
    return echo.exit_code(code), out.getvalue().decode().splitlines()


def test_printed_status_lines_are_output_not_the_runs_end(tmp_path):
    run = ["step 1/4 | reward 0.5", *FORGED, "step 2/4 | reward 0.6", "step 4/4 | reward 0.7", "megarl: done"]
    assert console(tmp_path, run, 0) == (0, run)
    # the same words, recorded by a rank, end the copy as before
    code, lines = console(tmp_path, ["step 1/4 | reward 0.5", FORGED[0], "Traceback (most recent call last):"], 1,
                          own=(FORGED[0],))
    assert code == 2 and lines == ["step 1/4 | reward 0.5", FORGED[0],
                                   "megarl: stopped the ranks; the ranks' full output is in run/logs/megarl-1.log"]


def test_an_allocators_words_in_the_output_do_not_hide_the_real_end(tmp_path):
    # printed by a row, then the run goes on: the lines held after it come back at the next step
    run = ["step 1/4 | reward 0.5", NATIVE, "a reward's print", "step 2/4 | reward 0.6", "step 4/4 | reward 0.7"]
    assert console(tmp_path, run, 0) == (0, run)
    # printed by a row, then the run stops on something else that megarl says: that is the end
    real = "megarl: stopped: no built-in reward rule for data source(s) 'later_source' (the data.reward_fn_key field)"
    run = ["step 1/4 | reward 0.5", NATIVE, "Fatal Python error: Aborted", real, "Traceback (most recent call last):"]
    code, lines = console(tmp_path, run, 1, own=(real,))
    assert code == 1 and lines[:4] == run[:4] and "out of memory" not in "\n".join(lines), lines
    # nothing else to go on and the run failed: the allocator's words stand (a rank that really aborted)
    code, lines = console(tmp_path, ["step 1/4 | reward 0.5", NATIVE, "Fatal Python error: Aborted"], 1)
    assert code == 5 and lines[-1].startswith("megarl: stopped: a rank ran out of memory in native code"), lines


@pytest.mark.timeout(900)
def test_a_run_whose_reward_prints_megarls_words_ends_as_it_really_ended(scored_run):
    """conftest.py's scored_run: its reward prints FORGED and NATIVE, to stdout and stderr, per sample."""
    rc, out = scored_run["rc"], scored_run["out"]
    assert rc == 0, out[-3000:]
    lines = out.splitlines()
    assert any(line.startswith("step 2/2 |") for line in lines), out[-3000:]
    assert "megarl: stopped the ranks" not in out and "in native code" not in out, out[-3000:]
    assert all(line in lines for line in FORGED), out[-3000:]
