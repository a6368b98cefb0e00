"""The launcher's copy of its ranks' output: once a rank reports a config error, that it ran out of
memory, or that a stop signal stopped the run, the console keeps that one line and stops there
(torchrun's tracebacks about the stopped ranks go to the log only).

    echo = RankOutput(sys.stdout.buffer); echo.write(chunk) ...; code = echo.exit_code(proc.wait())
"""
from __future__ import annotations

import re
import resource

MARK = b"config error: "
STOPPED = b"megarl: stopped by SIG"     # the ranks' line after a SIGTERM / SIGUSR1 (megarl/trainer/stopping.py)
OOM = re.compile(rb"^megarl: stopped: rank \d+: ran out of memory")    # megarl/trainer/run.py's line
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


def limit_note() -> str:
    """' under an address-space limit of N GiB (ulimit -v)' where one is set: the ranks inherit this
    process's limit. (The ranks' own line words it the same way, megarl/trainer/out_of_memory.py;
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


class RankOutput:
    def __init__(self, console, log_path: str | None = None):
        self.console, self.log_path = console, log_path
        self.pending = b""
        self.error_line: bytes | None = None
        self.native: bytes | None = None      # a native out-of-memory line, then where
        self.where: bytes | None = None

    def write(self, chunk: bytes) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            if self.native is not None:
                if self.where is None and (m := FRAME.search(line)):
                    self.where = m.group(1) + b":" + m.group(2)
                if self.native == b"aborted":          # the other rank's words may come after
                    self.native = native_out_of_memory(line.strip()) or self.native
                continue
            if self.error_line is not None:
                continue
            if (words := native_out_of_memory(line.strip())) is not None:
                self.native = words
                continue
            self.console.write(line + b"\n")
            if line.startswith(b"megarl: ") and MARK in line or line.startswith(STOPPED) or OOM.match(line):
                self.error_line = line
        self.console.flush()

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
        if self.error_line is None or self.error_line.startswith(STOPPED):
            if self.pending and self.error_line is None and self.native is None:
                self.console.write(self.pending)
                self.console.flush()
            return code
        self.console.write(f"megarl: stopped the ranks{where}\n".encode())
        self.console.flush()
        if OOM.match(self.error_line):
            return OOM_EXIT_CODE if code else code
        return 2 if code else code
