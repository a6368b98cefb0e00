"""Per-step metrics: one progress line on the console, one JSON record in metrics.jsonl, and
TensorBoard / Weights & Biases when installed and asked for (`trainer.logger`).

Metric names follow verl where it has one (critic/score/mean, actor/pg_loss, timing_s/gen, ...).
Only rank 0 writes; the other ranks' loggers are silent.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import string
import sys
import time
from typing import Any, TextIO

from megarl.config.interpolate import public_config

from megarl.storage.durable import write_durably
from megarl.storage.private_out import check_output_dir, open_append

# (label, candidate metric names, format): the first name present is shown.
PROGRESS_FIELDS = [
    ("reward", ("critic/score/mean", "critic/rewards/mean"), "{:.3f}"),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"), "{:.4f}"),
    ("entropy", ("actor/entropy",), "{:.3f}"),
    ("resp_len", ("response_length/mean",), "{:.1f}"),
    ("tok/s", ("perf/throughput",), "{:.0f}"),
    ("val_acc", ("val/accuracy",), "{:.3f}"),
]


def progress_line(step: int, total: int | None, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}" + (f"/{total}" if total else "")]
    for label, names, fmt in PROGRESS_FIELDS:
        for name in names:
            value = metrics.get(name)
            if value is not None:
                shown = fmt.format(value) if isinstance(value, (int, float)) else str(value)  # "nan" stays text
                parts.append(f"{label} {shown}")
                break
    phases = [(k.split("/", 1)[1], v) for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"]
    if phases:
        parts.append(" ".join(f"{name} {v:.1f}s" for name, v in phases if isinstance(v, (int, float))))
    if "timing_s/step" in metrics:
        parts.append(f"step {metrics['timing_s/step']:.1f}s")
    return " | ".join(parts)


def jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as text
    return value


class MetricsWriteError(RuntimeError):
    """metrics.jsonl could not take a step's record (a full disk); the run stops with this one line."""


class MetricsLogger:
    def __init__(self, run_dir: str, loggers: list[str], project: str, experiment: str,
                 config: dict | None = None, enabled: bool = True, stream: TextIO | None = None,
                 total_steps: int | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.backends: list[Any] = []
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if "tensorboard" in loggers:
            self.backends.append(_TensorBoard(os.path.join(run_dir, "tensorboard")))
        if "wandb" in loggers:
            self.backends.append(_WandB(project, experiment, config, run_dir))

    def log(self, step: int, metrics: dict[str, Any], print_line: bool = True) -> dict:
        record = {"step": step, "time": time.time(), **{k: jsonable(v) for k, v in metrics.items()}}
        if not self.enabled:
            return record
        self._append((json.dumps(record) + "\n").encode(), step)
        if print_line:
            print(progress_line(step, self.total_steps, record), file=self.stream, flush=True)
        for backend in self.backends:
            backend.log(step, record)
        return record

    def log_generations(self, step: int, samples: list[tuple[str, str, float]]) -> None:
        """trainer.log_val_generations' samples (input, output, score): a line each in
        val_generations.jsonl, and verl's table (wandb) or text (TensorBoard) per step."""
        if not self.enabled:
            return
        # trainer.log_dir may be outside the private run directory: never append through a link
        with open_append(os.path.join(os.path.dirname(self.path), "val_generations.jsonl"), "trainer.log_dir") as f:
            for text_in, text_out, score in samples:
                f.write(json.dumps({"step": step, "input": text_in, "output": text_out, "score": score},
                                   ensure_ascii=False) + "\n")
        for backend in self.backends:
            backend.log_generations(step, samples)

    def has_step(self, step: int) -> bool:
        return any(r.get("step") == step for r in read_metrics(os.path.dirname(self.path)))

    def _append(self, line: bytes, step: int) -> None:
        """One write of the whole line; a write that fails (a full disk) or falls short is taken back,
        so metrics.jsonl never ends in a torn line, and the run stops with one line saying so."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)   # private whatever the umask
        try:
            before = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:                  # a short write, then the next one says why (ENOSPC)
                    view = view[os.write(fd, view):]
            except OSError as err:
                try:
                    os.ftruncate(fd, before)
                except OSError:
                    pass
                raise MetricsWriteError(f"writing step {step}'s metrics to {self.path} failed "
                                        f"({err.strerror or err}); the file ends at the step before; free space "
                                        "and resume (the last checkpoint is intact)") from None
        finally:
            os.close(fd)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run logs them again) from metrics.jsonl and
        val_generations.jsonl, and a line cut short by a kill during its write (with a notice)."""
        if not self.enabled:
            return
        for path in (self.path, os.path.join(os.path.dirname(self.path), "val_generations.jsonl")):
            if os.path.exists(path):
                self._keep_until(path, step)

    def _keep_until(self, path: str, step: int) -> None:
        lines = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                record = _parse(line)
                if record is None:
                    self.info(f"megarl: dropped line {number} of {path}: not a complete JSON record "
                              f"(a write cut short by a kill): {line.strip()[:80]!r}")
                elif not _has_step(record):
                    self.info(f"megarl: dropped line {number} of {path}: its \"step\" is "
                              f"{str(record.get('step'))[:40]!r}, not a whole number; megarl writes each record "
                              "with its step (edit the line, or remove it, to keep it)")
                elif line.strip() and record["step"] <= step:
                    lines.append(line if line.endswith("\n") else line + "\n")
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, path)

    def info(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


class _TensorBoard:
    def __init__(self, logdir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional extra megarl[logging]
        except ImportError as err:  # tensorboard is an optional extra
            raise RuntimeError("trainer.logger includes tensorboard but the package is missing; "
                               "pip install tensorboard (or megarl[logging])") from err
        # trainer.log_dir may be shared: the event directory is held to the run directory's rule
        self.writer = SummaryWriter(check_output_dir(logdir, "trainer.log_dir"))

    def log(self, step: int, record: dict) -> None:
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, step: int, samples: list) -> None:
        text = f"**Generation Results - Step {step}**\n\n" + "".join(
            f"### Sample {i + 1}\n**Input:** {a}\n\n**Output:** {b}\n\n**Score:** {c}\n\n"
            for i, (a, b, c) in enumerate(samples))
        self.writer.add_text("val/generations", text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, project: str, experiment: str, config: dict | None, run_dir: str):
        try:
            import wandb  # optional extra megarl[logging]
        except ImportError as err:
            raise RuntimeError("trainer.logger includes wandb but the package is missing; "
                               "pip install wandb (or megarl[logging])") from err
        # Values read from the environment (tokens) go to wandb's servers as `<from env NAME>`.
        self.run = wandb.init(project=project, name=experiment, config=public_config(config), dir=run_dir,
                              id=wandb_run_id(run_dir), resume="allow")
        self.wandb, self.rows = wandb, []       # verl's validation table: one row per step, all steps kept

    def log(self, step: int, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k not in ("step", "time")}, step=step)

    def log_generations(self, step: int, samples: list) -> None:
        columns = ["step"] + [f"{name}_{i + 1}" for i in range(len(samples)) for name in ("input", "output", "score")]
        self.rows.append([step] + [x for sample in samples for x in sample])
        self.run.log({"val/generations": self.wandb.Table(columns=columns, data=self.rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


WANDB_ID_FILE = "wandb_run_id"
_WANDB_ID = re.compile(r"^[^\s:;,#?/']{1,128}$")       # wandb's rule (wandb_settings.validate_run_id)


def new_wandb_id() -> str:
    """8 random base-36 characters, the form wandb's own ids take (wandb 0.31: sdk/lib/runid.py);
    made here, since wandb 0.31's public modules offer no id generator (wandb.util has none)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_run_id(run_dir: str, generate=new_wandb_id) -> str:
    """The run's wandb id: the user's WANDB_RUN_ID, else the one kept in the run directory, made once
    by `generate` on the first start. resume="allow" without an id starts a new wandb run on every
    resume; with the same id each resume continues the one run."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    path = os.path.join(run_dir, WANDB_ID_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        made = generate()
        write_durably(path, made + "\n")
        return made
    with os.fdopen(fd) as f:
        kept = f.read(100).strip()
    if not _WANDB_ID.match(kept):
        raise RuntimeError(f"{path} holds {kept[:20]!r}, not a wandb run id (1-128 characters, none of "
                           ":;,#?/' or spaces); delete it to start a new wandb run, or write the id of the run "
                           "to continue")
    return kept


def _has_step(record: dict) -> bool:
    """A record megarl wrote: its step is an int (a line edited by hand may hold "note" or 1.5,
    which no step compares with)."""
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool)


def _parse(line: str) -> dict | None:
    """A record, or None for a line that is not one (torn by a kill mid-write); blank lines are {}."""
    if not line.strip():
        return {"step": -1}
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(run_dir: str) -> list[dict]:
    """The records of metrics.jsonl; a torn line (a kill during a write) or one without a whole-number
    step is left out."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [r for r in map(_parse, f) if r is not None and _has_step(r) and r["step"] != -1]
