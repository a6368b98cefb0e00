"""Two launches at once on a fresh quickstart model path: one builds the model, the other waits for
it and uses it; the directory the first returned is never replaced under it. Two real processes
run the real bootstrap (a short warm start) against one path. The first holds its build until the
second has said it waits, so the order does not depend on how the two are scheduled.

    python -m pytest -q tests/faults/test_bootstrap_race.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

BUILD = textwrap.dedent("""
    import os, sys, time
    from megarl.examples.addition import bootstrap
    from megarl.examples.addition import checkpoint

    def wait_for(path):
        while not os.path.exists(path):
            time.sleep(0.01)

    train = checkpoint.supervised_train
    def held_train(*args, **kwargs):            # the build pauses, lock held, until told to go on
        if sys.argv[3] != "-":
            wait_for(sys.argv[3])
        return train(*args, **kwargs)
    checkpoint.supervised_train = held_train
    print("imported", flush=True)
    wait_for(sys.argv[2])                         # start only when told
    path = bootstrap(sys.argv[1], warm_start_steps=60, eval_rows=8)
    print("returned", os.stat(path).st_ino, flush=True)
""")


def test_two_bootstraps_of_one_path_build_once_and_replace_nothing(tmp_path):
    model = tmp_path / "models" / "addition"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    go = [tmp_path / "go1", tmp_path / "go2"]
    release = tmp_path / "release"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(model), str(g), r], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
             for g, r in zip(go, [str(release), "-"])]
    try:
        for proc in procs:         # both have paid for their imports before the first starts building
            assert proc.stdout.readline() == "imported\n"
        go[0].touch()
        first = ""
        while "megarl: bootstrapping the addition model" not in first:   # the first holds the lock, mid-build
            line = procs[0].stdout.readline()
            assert line, first
            first += line
        go[1].touch()
        second = ""
        while "megarl: waiting for pid " not in second:                 # the second meets the lock
            line = procs[1].stdout.readline()
            assert line, second
            second += line
        release.touch()
        outs = [first + procs[0].communicate(timeout=600)[0], second + procs[1].communicate(timeout=600)[0]]
    finally:                   # a failed check leaves no process waiting for its file
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    built = [out for out in outs if "megarl: bootstrapping the addition model" in out]
    waited = [out for out in outs if "megarl: waiting for pid " in out and f"which is building {model}" in out]
    assert built == [outs[0]] and waited == [outs[1]], outs
    inodes = {line.split()[1] for out in outs for line in out.splitlines() if line.startswith("returned ")}
    assert inodes == {str(os.stat(model).st_ino)}, (inodes, outs)      # one directory, never replaced
    assert (model / "config.json").is_file()
    assert not [n for n in os.listdir(model.parent) if n.startswith((".bootstrap-", ".replaced-"))]
