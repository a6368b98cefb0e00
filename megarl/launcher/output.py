"""The launcher's copy of its ranks' output: once a rank reports a config error, or that a stop signal
stopped the run, the console keeps that one line and stops there (torchrun's tracebacks about the
stopped ranks go to the log only).

    echo = RankOutput(sys.stdout.buffer); echo.write(chunk) ...; code = echo.exit_code(proc.wait())
"""
from __future__ import annotations

MARK = b"config error: "
STOPPED = b"megarl: stopped by SIG"     # the ranks' line after a SIGTERM / SIGUSR1 (megarl/trainer/stopping.py)


class RankOutput:
    def __init__(self, console, log_path: str | None = None):
        self.console, self.log_path = console, log_path
        self.pending = b""
        self.error_line: bytes | None = None

    def write(self, chunk: bytes) -> None:
        if self.error_line is not None:
            return
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self.console.write(line + b"\n")
            if line.startswith(b"megarl: ") and MARK in line or line.startswith(STOPPED):
                self.error_line = line
                break
        self.console.flush()

    def exit_code(self, code: int) -> int:
        """The ranks' exit code, or 2 (a config error) once one reported its line."""
        if self.error_line is None or self.error_line.startswith(STOPPED):
            if self.pending and self.error_line is None:
                self.console.write(self.pending)
                self.console.flush()
            return code
        where = f"; the ranks' full output is in {self.log_path}" if self.log_path else ""
        self.console.write(f"megarl: stopped the ranks{where}\n".encode())
        self.console.flush()
        return 2 if code else code
