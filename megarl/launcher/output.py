"""The launcher's copy of its ranks' output: once a rank reports a config error, that it ran out of
memory, or that a stop signal stopped the run, the console keeps that one line and stops there
(torchrun's tracebacks about the stopped ranks go to the log only).

    echo = RankOutput(sys.stdout.buffer, log_path, records); echo.write(chunk) ...; echo.exit_code(proc.wait())

Only megarl's own lines count: a rank records each of its status lines in the launcher's file
`records` before printing it (megarl/parallel/own_lines.py), and a line that reads like one but is
not in the file (a data row, a reward's print) is just output. Native code's out-of-memory words
cannot be recorded: they count only if the run then fails with no status line of megarl's, and the
lines after them are held, not dropped, until the run shows it goes on (a progress line, or
megarl's own line).
"""
from __future__ import annotations

import re
import resource

MARK = b"config error: "
STOPPED = b"megarl: stopped by SIG"     # the ranks' line after a SIGTERM / SIGUSR1 (megarl/trainer/control/stopping.py)
OOM = re.compile(rb"^megarl: stopped: rank \d+: ran out of memory")    # megarl/job/run.py's line
OOM_EXIT_CODE = 5
# A rank that runs out of memory outside Python ends without megarl's line: native code aborts the
# process (Rust's allocator in HF tokenizers, a C++ std::bad_alloc), or an import fails to map a
# library. These are their own words on the rank's stderr; the innermost megarl frame of the
# fatal-error dump that follows says where. Searched, not matched whole: two ranks that abort at
# once share one stderr, and Rust writes its line in pieces ("memory allocation of memory
# allocation of 6 bytes failed").
NATIVE_OOM = re.compile(rb"memory allocation of \d+ bytes failed|memory allocation of "
                        rb"|terminate called after throwing an instance of 'std::bad_alloc'"
                        rb"|^MemoryError\b.*"
                        rb"|ImportError: .*failed to map segment from shared object.*")
# Any other abort of a rank under an address-space limit: most likely memory too (a thread's stack
# that cannot map, an allocation inside a C++ library that throws its own error type).
ABORTED = b"Fatal Python error: Aborted"
FRAME = re.compile(rb'File "[^"]*/(megarl/[^"]+)", line (\d+)')
PROGRESS = re.compile(rb"^step \d+(/\d+)? \|")        # megarl/trainer/metrics/logger.py progress_line: a step ended
HOLD_LINES = 5000


def limit_note() -> str:
    """' under an address-space limit of N GiB (ulimit -v)' where one is set: the ranks inherit this
    process's limit. (The ranks' own line words it the same way, megarl/trainer/control/out_of_memory.py;
    this module imports no megarl, so the launcher's copy starts before torch loads.)"""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" under an address-space limit of {soft / 2**30:.1f} GiB (ulimit -v)"


def native_out_of_memory(line: bytes) -> bytes | None:
    """The words of a native out-of-memory line (b"aborted" for a bare abort under a limit), else None."""
    if m := NATIVE_OOM.search(line):
        words = m.group(0).strip()
        return b"memory allocation failed" if words == b"memory allocation of" else words
    if ABORTED in line and limit_note():
        return b"aborted"
    return None


def status_line(line: bytes) -> bool:
    """Reads as one of the ranks' status lines that end the console's copy."""
    return line.startswith(b"megarl: ") and MARK in line or line.startswith(STOPPED) or bool(OOM.match(line))


class RankOutput:
    def __init__(self, console, log_path: str | None, records: str):
        self.console, self.log_path, self.records = console, log_path, records
        self.pending = b""
        self.error_line: bytes | None = None
        self.native: bytes | None = None      # a native out-of-memory line, then where
        self.where: bytes | None = None
        self.held: list[bytes] = []           # lines after a native one, until the run shows it goes on

    def own(self, line: bytes) -> bool:
        """`line` is in the records file: a megarl process wrote it (own_line)."""
        try:
            with open(self.records, "rb") as f:
                return line.rstrip(b"\r") in f.read().split(b"\n")
        except OSError:
            return False

    def write(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            if self.error_line is not None:
                continue
            # A line megarl's processes recorded: the run's own word, which beats an allocator's.
            mine = line.startswith(b"megarl: ") and self.own(line)
            if self.native is not None and not mine:
                if PROGRESS.match(line) or len(self.held) >= HOLD_LINES:
                    self._release()          # a step ended (or a dying rank says no more): the run goes on
                else:
                    self.held.append(line)
                    if self.where is None and (m := FRAME.search(line)):
                        self.where = m.group(1) + b":" + m.group(2)
                    if self.native == b"aborted":          # the other rank's words may come after
                        self.native = native_out_of_memory(line.strip()) or self.native
                    continue
            if self.native is None and (words := native_out_of_memory(line.strip())) is not None:
                self.native = words
                self.held = [line]
                continue
            if mine:
                self._release()
                if status_line(line):
                    self.error_line = line
            self.console.write(line + b"\n")
        self.console.flush()

    def _release(self) -> None:
        for line in self.held:
            self.console.write(line + b"\n")
        self.native, self.where, self.held = None, None, []

    def exit_code(self, code: int) -> int:
        """The ranks' exit code; 2 once one reported a config error, 5 once one ran out of memory."""
        where = f"; the ranks' full output is in {self.log_path}" if self.log_path else ""
        if self.native is not None and self.error_line is None and code:
            at = f", at {self.where.decode()}" if self.where else ""
            what = (f"aborted in native code ({at[2:] or 'no megarl frame'}){limit_note()}, most likely out of memory"
                    if self.native == b"aborted" else
                    f"ran out of memory in native code ({self.native.decode()}{at}){limit_note()}")
            self.console.write(f"megarl: stopped: a rank {what}; give the run more memory, or lower what a rank holds "
                               f"(the data, the model's size per rank: tensor_model_parallel_size){where}\n".encode())
            self.console.flush()
            return OOM_EXIT_CODE
        self._release()
        if self.error_line is None or self.error_line.startswith(STOPPED):
            if self.pending and self.error_line is None:
                self.console.write(self.pending)
                self.console.flush()
            return code
        self.console.write(f"megarl: stopped the ranks{where}\n".encode())
        self.console.flush()
        if OOM.match(self.error_line):
            return OOM_EXIT_CODE if code else code
        return 2 if code else code
