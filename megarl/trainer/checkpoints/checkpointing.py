"""Step checkpoints: everything a run needs to continue exactly where it stopped.

    <trainer.default_local_dir>/
        latest_checkpointed_iteration.txt     the newest *complete* step (verl's file name)
        global_step_20/
            actor/  critic/                   megatron distributed checkpoints (reshardable)
            trainer_state.pt                  step, data position, KL controller, bad-step count
            rng/rank_<r>.pt                   each rank's torch / numpy / python RNG streams
            manifest.json                     SHA-256 of every file above (verified_io)
        global_step_20.tmp/                   a save in progress: ignored and removed on resume

A save writes into `global_step_N.tmp`, every rank finishes, then rank 0 renames it and moves
the pointer file atomically: a job killed mid-save resumes from the previous complete step.
Files are 0600, directories 0700, and everything is fsynced before the rename and the pointer.
trainer_state.pt and rng/*.pt hold plain data read with torch's weights-only unpickler; a resume
reads nothing until verified_io.verify accepts the step (see docs/security.md).
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
import traceback

import numpy as np
import torch
import torch.distributed as dist

# The classes a trainer state holds (DataProto, SamplingParams) register with storage/plain_state.py
# where they are defined: importing them here lets any reader of a step decode them.
import megarl.protocol  # noqa: F401
import megarl.rollout.base  # noqa: F401
from megarl.config import ConfigError
from megarl.trainer.checkpoints import staging, verified_io
from megarl.trainer.control.faults import fault_point
from megarl.workers.checkpoint import CheckpointMismatch

POINTER = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def complete_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "trainer_state.pt")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def incomplete_steps(root: str) -> list[int]:
    """Step directories without trainer_state.pt: a save that never finished (or was damaged)."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root))
                  if m and not os.path.isfile(os.path.join(root, m.group(0), "trainer_state.pt")))


def latest_step_dir(root: str) -> str | None:
    """The directory of the newest complete checkpoint under `root`, or None."""
    pointer = os.path.join(root, POINTER)
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8", errors="replace") as f:
            text = f.read(64).strip()
        # isdigit() alone takes '²' and other digits int() refuses: a damaged pointer is ignored, not a traceback.
        if (text.isascii() and text.isdigit()
                and os.path.isfile(os.path.join(step_dir(root, int(text)), "trainer_state.pt"))):
            return step_dir(root, int(text))
    steps = complete_steps(root)  # pointer missing or stale: fall back to the newest complete dir
    return step_dir(root, steps[-1]) if steps else None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointSaveError(RuntimeError):
    """A save failed for a reason outside the program (a full disk, a lost mount): one line."""


def save(root: str, step: int, roles: dict, trainer_state: dict, rank: int, keep: int | None, say=None) -> str:
    """Collective: every rank calls it. `roles` maps a name to a worker with save_checkpoint(dir).
    An existing global_step_N is never replaced in silence: an incomplete one is moved aside to
    global_step_N.incomplete, a complete one (a run started over) is replaced with a line (`say`).
    Before the rename every file is made private, fsynced and listed in manifest.json (verified_io).
    A save that fails on the filesystem (ENOSPC, EIO, ...) removes its partial directory and
    raises CheckpointSaveError naming the step, the error and the last complete checkpoint."""
    try:
        return _save(root, step, roles, trainer_state, rank, keep, say)
    except BaseException as err:  # torch's CheckpointException is a BaseException
        peer = getattr(err, "failed_rank", rank)    # PeerSaveFailed, verified_io.SealError
        cause = err.cause if isinstance(err, PeerSaveFailed) else _os_error(err) or _disk_full(root)
        if cause is None or isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        if rank == 0:
            shutil.rmtree(step_dir(root, step) + ".tmp", ignore_errors=True)   # gives the space back
        last = latest_step_dir(root)
        raise CheckpointSaveError(
            f"saving step {step} failed on rank {peer}: {cause.strerror or cause}"
            + (f" ({cause.filename})" if cause.filename else "") + f"; the partial save was removed and the last "
            f"complete checkpoint is {last or 'none'}; free space (or fix the filesystem), then run the same "
            "command to resume") from None


class PeerSaveFailed(RuntimeError):
    """A save failed on some rank: raised on every rank once they agree (`_agree`), naming the
    rank whose failure has a filesystem cause (`cause`, an OSError), or the lowest failed rank."""

    def __init__(self, step: int, rank: int, cause: OSError | None):
        self.failed_rank, self.cause = rank, cause
        super().__init__(f"saving step {step} failed on rank {rank}"
                         + (f": {cause.strerror or cause}" if cause
                            else " (not a filesystem error: its traceback says why)"))


def _attempt(fn) -> BaseException | None:
    """Run one rank's part of a save; its failure, kept until every rank has heard of it."""
    try:
        fn()
        return None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:   # noqa: BLE001 - torch's CheckpointException; re-raised by _agree
        return err


def _agree(step: int, root: str, failed: BaseException | None) -> None:
    """A barrier that also shares failure. Where any rank's part failed (a rank-0-only write on a
    full disk; megatron's save, which tells the other ranks only that it failed), every rank raises
    here, with the filesystem cause one of them found, instead of going on into a collective the
    failed rank never reaches and dying of a lost connection."""
    cause = (_os_error(failed) or _disk_full(root)) if failed is not None else None
    if not dist.is_initialized():
        if failed is not None:
            raise (PeerSaveFailed(step, 0, cause) if cause is not None and cause.errno else failed)
        return
    rank = dist.get_rank()
    who = getattr(failed, "failed_rank", rank)    # verified_io.SealError: every rank raises one rank's failure
    errno_ = (cause.errno or 0) if cause is not None else 0
    none = -(1 << 30)
    # MAX-reduced: [any failed, -(lowest failed rank), largest errno, -(lowest rank with an errno)]
    mine = torch.tensor([int(failed is not None), -who if failed is not None else none, errno_,
                         -who if errno_ else none], dtype=torch.int64,
                        device="cuda" if dist.get_backend() == "nccl" else "cpu")   # NCCL reduces device tensors
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    any_failed, lowest, errno_all, with_errno = (int(v) for v in mine)
    if not any_failed:
        return
    if errno_all:      # the rank that found it keeps its full cause (with the file name)
        found = cause if -with_errno == who else OSError(errno_all, os.strerror(errno_all))
        raise PeerSaveFailed(step, -with_errno, found) from failed
    if failed is not None:
        raise failed
    raise PeerSaveFailed(step, -lowest, None)


def _disk_full(root: str) -> OSError | None:
    """torch's zip writer reports a short write as "unexpected pos N vs M", without an errno:
    a failed save on a filesystem with (almost) no room left is taken as a full disk."""
    try:
        full = shutil.disk_usage(root).free < (1 << 20)
    except OSError:
        return None
    return OSError(errno.ENOSPC, "No space left on device", root) if full else None


def _os_error(err: BaseException, depth: int = 0) -> OSError | None:
    """The OSError behind `err`: itself, its cause/context, or a rank's failure inside torch's
    CheckpointException (megatron's writer processes send theirs back that way)."""
    if err is None or depth > 6:
        return None
    if isinstance(err, OSError) and err.errno is not None:
        return err
    inner = [pair[0] for pair in getattr(err, "failures", {}).values() if isinstance(pair, tuple)]
    for e in (*inner, err.__cause__, err.__context__):
        found = _os_error(e, depth + 1) if isinstance(e, BaseException) else None
        if found is not None:
            return found
    if "No space left on device" in str(err):  # megatron's writer can report it only as text
        return OSError(errno.ENOSPC, "No space left on device")
    return None


def _save(root: str, step: int, roles: dict, trainer_state: dict, rank: int, keep: int | None, say=None) -> str:
    final = step_dir(root, step)
    tmp = final + ".tmp"

    def prepare():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            verified_io.make_private_dir(root)
            os.makedirs(os.path.join(tmp, "rng"), mode=0o700)
    _agree(step, root, _attempt(prepare))

    def role_checkpoints():
        for name, worker in roles.items():
            # collective: megatron's distributed save fails on every rank when one rank's write fails
            worker.save_checkpoint(os.path.join(tmp, name))
    _agree(step, root, _attempt(role_checkpoints))

    def local_files():
        verified_io.save_plain(rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        fault_point("save", step, rank)
        if rank == 0:
            verified_io.save_plain(trainer_state, os.path.join(tmp, "trainer_state.pt"))  # marks completeness
    _agree(step, root, _attempt(local_files))
    _agree(step, root, _attempt(lambda: verified_io.seal(tmp)))
    _agree(step, root, _attempt(lambda: _publish(root, step, final, tmp, rank, keep, say)))
    return final


def _publish(root: str, step: int, final: str, tmp: str, rank: int, keep: int | None, say) -> None:
    """Rank 0: the sealed step under its final name, the latest pointer, old steps pruned."""
    if rank == 0:
        if os.path.isdir(final):
            if os.path.isfile(os.path.join(final, "trainer_state.pt")):
                (say or print)(f"megarl: replacing the earlier run's checkpoint {final}")
                shutil.rmtree(final, ignore_errors=True)
            else:
                aside = final + ".incomplete"
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                (say or print)(f"megarl: {final} had no trainer_state.pt (an incomplete save); moved it to {aside}")
        os.replace(tmp, final)
        verified_io.fsync_dir(root)
        verified_io.write_durably(os.path.join(root, POINTER), str(step))
        _prune(root, keep)


def _prune(root: str, keep: int | None) -> None:
    if not keep or keep < 1:
        return
    for old in complete_steps(root)[:-keep]:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)


def clean_partial(root: str) -> list[str]:
    """Remove saves that never completed (`*.tmp`); returns what was removed."""
    removed = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("global_step_") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(name)
    return removed


def resume_dir(cfg) -> str | None:
    """Where to resume from per trainer.resume_mode, or None for a fresh start."""
    tr = cfg.trainer
    if tr.resume_mode == "disable":
        return None
    if tr.resume_mode == "resume_path":
        path = tr.resume_from_path
        if not os.path.isfile(os.path.join(path, "trainer_state.pt")):
            raise ConfigError(f"{path} is not a complete megarl step checkpoint (no trainer_state.pt); point it at "
                              "a global_step_N directory", "trainer.resume_from_path")
        return path
    return latest_step_dir(tr.default_local_dir)


def load(path: str, roles: dict, rank: int, world: int, say=None) -> dict:
    """Load role checkpoints (any TP/PP) and RNG streams; returns the trainer state. Collective.
    Nothing is read before verified_io.verify accepts the whole step (owner, mode, manifest
    digests), through the step directory held open, so megatron reads only the bytes that were
    checked (staging.checked_step, which tells `say` why that is safe where the step lies). A file
    that fails is one line naming the step, the file and the fix."""
    try:
        with staging.checked_step(path, list(roles), say) as (src, _):
            for name, worker in roles.items():
                sub = os.path.join(path, name)
                if not os.path.isdir(sub):
                    raise ConfigError(f"{path} has no {name}/ checkpoint but this run trains a {name}; resume with "
                                      "the same roles or start fresh (trainer.resume_mode=disable)",
                                      "trainer.resume_mode")
                _reading(path, sub, lambda: worker.load_checkpoint(os.path.join(src, name)), intact=True)
    except verified_io.Refused as err:
        raise ConfigError(f"cannot resume from {os.path.basename(os.path.normpath(path))}: {err}; megarl loads no "
                          "checkpoint file it cannot vouch for. If you trust it, fix its owner/mode; otherwise start "
                          "over with trainer.resume_mode=disable, or pick an earlier step with trainer.resume_mode="
                          "resume_path trainer.resume_from_path=<run dir>/global_step_N",
                          "trainer.resume_mode") from None
    state = read_trainer_state(path)
    rng_file = os.path.join(path, "rng", f"rank_{rank}.pt")
    if state.get("world") == world:     # the same world: the resume is bitwise only with every stream
        if not os.path.isfile(rng_file):
            raise _damaged(path, os.path.relpath(rng_file, path), "is missing")
        set_rng_state(_reading(path, rng_file,
                               lambda: verified_io.load_sealed(path, os.path.relpath(rng_file, path))))
    return state


def rng_notice(state: dict, world: int) -> str | None:
    """The line a resume prints when it cannot restore the RNG streams (saved per rank, so only
    into the same world size); None when it did."""
    saved = state.get("world")
    if saved == world:
        return None
    return (f"megarl: the checkpoint was saved by {saved} ranks and this run has {world}: model, optimizer, "
            "data position and KL controller are restored, the random streams are not (each rank keeps its "
            "freshly seeded one), so sampling from here on differs from an uninterrupted run")


def read_trainer_state(path: str) -> dict:
    """trainer_state.pt of a step that load() has verified."""
    state_file = os.path.join(path, "trainer_state.pt")
    return _reading(path, state_file, lambda: verified_io.load_sealed(path, "trainer_state.pt"))


def _damaged(step_path: str, rel: str, why: str) -> ConfigError:
    return ConfigError(f"cannot resume from {os.path.basename(step_path)}: {rel} {why}; the checkpoint is damaged: "
                       "start over with trainer.resume_mode=disable, or pick an earlier one with trainer.resume_mode="
                       "resume_path trainer.resume_from_path=<run dir>/global_step_N", "trainer.resume_mode")


def _reading(step_path: str, what: str, fn, intact: bool = False):
    """fn(), or one line naming the step, the file and the fix. `intact`: every byte fn reads was
    checked against the step's manifest, so a failure is no damage but a checkpoint this megarl and
    megatron-core cannot load (or a bug): the line says so, and the traceback goes to the log."""
    try:
        return fn()
    except ConfigError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch's CheckpointException is a BaseException of hundreds of lines
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        if getattr(err, "failures", None):   # the failing rank's own exception, not torch's wrapper
            inner = next(iter(err.failures.values()))[0]
            first = f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
        rel, why = os.path.relpath(what, step_path), f"({type(err).__name__}: {first[:300]})"
        if isinstance(err, CheckpointMismatch):
            raise ConfigError(f"cannot resume from {os.path.basename(step_path)}: {rel}: {first}",
                              "trainer.resume_mode") from None
        if not intact:
            raise _damaged(step_path, rel, f"could not be read {why}") from None
        refused = ConfigError(f"cannot resume from {os.path.basename(step_path)}: {rel} matches the step's manifest "
                              f"byte for byte, yet loading it failed {why}: the files are intact, this megarl or "
                              "megatron-core cannot load them (the traceback follows in the run's log); resume "
                              "with the versions that saved it, or start over with trainer.resume_mode=disable",
                              "trainer.resume_mode")
        refused.detail = "".join(traceback.format_exception(err)).rstrip()
        raise refused from None
