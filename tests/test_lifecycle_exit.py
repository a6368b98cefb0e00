"""lifecycle.exit_now leaves as a normal exit would, less the interpreter's teardown: the exit code,
what a thread still writing, an atexit handler, a file left open and stdout all hold, and an
executor never shut down does not keep it waiting."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import atexit, sys, threading, time
    from megarl.parallel.lifecycle import exit_now
    out = sys.argv[1]
    left_open = open(out + "/open.txt", "w")          # never closed, never flushed
    left_open.write("tail")
    atexit.register(lambda: open(out + "/atexit.txt", "w").write("ran"))
    def late():
        time.sleep(0.5)
        with open(out + "/thread.txt", "w") as f:
            f.write("done")
    threading.Thread(target=late).start()
    from concurrent.futures import ThreadPoolExecutor
    idle = ThreadPoolExecutor(2)                         # never shut down: its workers wait on a queue
    idle.submit(time.sleep, 0.1).result()
    sys.stdout.write("no newline, buffered")
    exit_now(7)
    open(out + "/after.txt", "w").write("never")
""")


def test_exit_now_keeps_what_a_normal_exit_keeps(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, stdin=subprocess.DEVNULL)
    assert out.returncode == 7, out.stderr[-2000:]
    assert out.stdout == "no newline, buffered"
    assert (tmp_path / "open.txt").read_text() == "tail"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert not (tmp_path / "after.txt").exists()



def test_open_files_are_found_by_type_once_per_type():
    """exit_now looks through every object of the process for open files: a check per type, by its
    MRO, not issubclass against io.IOBase's ABC (about 0.4 ms for each type the ABC has not seen)."""
    import io
    import time

    from megarl.parallel.lifecycle import open_files
    # The ABC's first check of a type walks every subclass of io.IOBase: a rank's libraries bring hundreds.
    kinds = [type(f"Kind{i}", (io.RawIOBase,), {}) for i in range(300)]
    objects = [type(f"Unseen{i}", (), {})() for i in range(5000)] + [object()] * 100_000
    buffered, text = io.BufferedWriter(io.BytesIO()), io.StringIO()
    subclassed = kinds[0]()
    objects += [buffered, text, subclassed]
    start = time.perf_counter()
    found = open_files(objects)
    took = time.perf_counter() - start
    assert found == [buffered, text, subclassed]
    assert took < 0.5, f"{took:.2f} s for {len(objects)} objects of 5,000 types"     # issubclass: 3-4 s
