"""The one line a failed Slurm job ends with: which rank, on which node, failed first.

`python -m megarl.launcher.failure LOG MODE NODE...` (launch/slurm/job.sh) reads the job's log: srun's
labelled output, with every node's torchrun failure summary in it.

torchrun's own "Root Cause (first observed failure)" is the failure with the smallest timestamp, and
those timestamps are whole seconds: the rank killed at 12.99 s is seen by torchrun's next poll at
13.05 s, while its neighbour, whose socket closed at 12.99 s, has already written an error file
stamped 12. So the summary's every entry is read, and the rank to name is the one whose death
cannot have been a reaction to another's: a fatal signal (SIGKILL from the OOM killer or a user,
SIGSEGV, SIGBUS...) before an exit code, and an exit code before SIGTERM, which is how torchrun and
srun stop the ranks that were still running. Within each kind torchrun's order stands.
"""
from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass

FATAL_SIGNALS = frozenset(-int(s) for s in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL,
                                             signal.SIGFPE))
STOPPED = -int(signal.SIGTERM)
ATTEMPT = re.compile(r"^megarl: job \d+ \(restart \d+\) on ")
# srun's own reports start a line; everything a task prints is behind its `--label` prefix ("3: "),
# so a rank that prints "srun: error: ... Killed" (or a whole torchrun summary) cannot pass for srun,
# nor for another task. Task numbers are bounded: a label of thousands of digits is no task.
SRUN_FAILED_TASK = re.compile(r"^srun: error: [^:]+: task (\d{1,7}): (Exited|Killed)")
SRUN_FAILED_ANY = re.compile(r"^srun: error: [^:]+: tasks? [0-9,-]+: ")
LABEL = re.compile(r"^\s*(\d{1,7}): ?(.*)$")


@dataclass
class Failure:
    rank: str       # "3 (local_rank: 1)", as torchrun prints it
    exitcode: str   # "-9 (pid: 15655)  (SIGKILL)"

    @property
    def code(self) -> int:
        try:
            return int(self.exitcode.split()[0])
        except (IndexError, ValueError):     # not torchrun's "N (pid: P)": an exit, as far as can be told
            return 1

    def kind(self) -> int:
        """0: died by itself of a fatal signal; 1: exited; 2: stopped by SIGTERM."""
        return 0 if self.code in FATAL_SIGNALS else 2 if self.code == STOPPED else 1

    def line(self) -> str:
        return " ".join(f"rank : {self.rank}; exitcode : {self.exitcode}".split())


def this_attempt(lines: list[str]) -> list[str]:
    """A requeued job appends to the same log: only its last attempt's lines count."""
    starts = [i for i, line in enumerate(lines) if ATTEMPT.match(line)]
    return lines[starts[-1]:] if starts else lines


def ends_with_summary(lines: list[str], task: str) -> bool:
    """torchrun prints its summary as it exits: a task whose output goes on after its last summary
    had a rank print that text, and its torchrun has not failed (yet)."""
    own = [m.group(2).strip() for m in map(LABEL.match, lines) if m and m.group(1) == task]
    begins = [i for i, line in enumerate(own) if line.endswith(" FAILED")]
    return bool(begins) and all(line.startswith(("=", "-")) or not line for line in own[-1:])


def summary_of(lines: list[str], task: str) -> list[Failure]:
    """The failures in task's last torchrun summary, root cause first, then the others as printed."""
    own = [m.group(2) for m in map(LABEL.match, lines) if m and m.group(1) == task]
    begins = [i for i, line in enumerate(own) if line.rstrip().endswith(" FAILED")]
    if not begins:
        return []
    root: list[Failure] = []
    others: list[Failure] = []
    into, rank = others, None
    for line in own[begins[-1]:]:
        text = line.strip()
        if text.startswith("Root Cause"):
            into = root
        elif text.startswith("rank") and ":" in text:
            rank = text.split(":", 1)[1].strip()
        elif text.startswith("exitcode") and ":" in text and rank is not None:
            into.append(Failure(rank, text.split(":", 1)[1].strip()))
            rank = None
    return root + others


def first_failure(log: str, mode: str, nodes: list[str]) -> str:
    lines = this_attempt(log.splitlines())
    if mode == "torchrun":
        # The node whose task srun saw fail first is the one to read: a peer node's torchrun may
        # print its own summary first (its ranks saw their connections close).
        failed = next((m.group(1) for m in map(SRUN_FAILED_TASK.search, lines) if m), None)
        summaries = [m.group(1) for m in map(LABEL.match, lines) if m and m.group(2).rstrip().endswith(" FAILED")]
        tasks = [failed] if failed is not None else sorted(dict.fromkeys(summaries),
                                                          key=lambda t: not ends_with_summary(lines, t))
        for task in tasks:
            # The task srun names died without a summary of its torchrun's (killed with it) if its
            # output goes on after the last one: that one a rank printed; srun's own line says more.
            failures = summary_of(lines, task) if task != failed or ends_with_summary(lines, task) else []
            if failures:
                chosen = min(failures, key=Failure.kind)   # min keeps the first of equals: torchrun's order
                node = nodes[int(task)] if int(task) < len(nodes) else f"task {task}"   # at most 7 digits
                return f"on node {node}: {chosen.line()}"
    # No torchrun summary (a task that stopped before torchrun started, or the task form, where
    # task N is rank N): srun's report of the first task that did not merely get terminated.
    reported = [line for line in lines if SRUN_FAILED_ANY.search(line) and not line.rstrip().endswith(": Terminated")]
    return reported[0].strip() if reported else "not reported (see the lines above)"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m megarl.launcher.failure LOG MODE [NODE...]", file=sys.stderr)
        return 2
    path, mode, nodes = argv[0], argv[1], argv[2:]
    try:
        with open(path, errors="replace") as f:
            log = f.read()
    except OSError as err:
        print(f"not reported (cannot read {path}: {err.strerror})")
        return 0
    print(first_failure(log, mode, nodes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
