"""A checkpoint file megarl reads is hashed and loaded from the same bytes, read once through one
descriptor: a file swapped after verify() checked the step (the window a resume used to leave open,
24-340 ms on a loaded machine) is refused, never loaded. In-process, on a step sealed here (~1 s);
megatron's own files on a real two-rank megatron checkpoint (one spawn of 2 gloo ranks), read through
the step directory held open: a run directory moved away after the check is never read, and nothing
is copied to TMPDIR.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from megarl.config import ConfigError
from megarl.parallel import cpu_compat
from megarl.trainer.checkpoints import checkpointing, verified_io
from megarl.workers.checkpoint import megatron_results_queue_in_process
from tests.distributed import run_ranks


def sealed_step(tmp_path):
    step = tmp_path / "global_step_2"
    verified_io.make_private_dir(str(tmp_path))
    verified_io.make_private_dir(str(step))
    verified_io.make_private_dir(str(step / "rng"))
    verified_io.save_plain({"step": 2, "bad_steps": 0}, str(step / "trainer_state.pt"))
    verified_io.save_plain({"torch": torch.tensor([1, 2, 3])}, str(step / "rng" / "rank_0.pt"))
    verified_io.seal(str(step))
    return str(step)


def test_a_file_swapped_after_the_check_is_refused_at_its_load(tmp_path):
    step = sealed_step(tmp_path)
    verified_io.verify(step)
    assert verified_io.load_sealed(step, "trainer_state.pt") == {"step": 2, "bad_steps": 0}
    assert checkpointing.read_trainer_state(step)["step"] == 2          # what a resume calls
    assert verified_io.load_sealed(step, "rng/rank_0.pt")["torch"].tolist() == [1, 2, 3]
    # after verify() accepted the step, another valid file takes trainer_state.pt's place
    swapped = tmp_path / "other.pt"
    verified_io.save_plain({"step": 9, "bad_steps": 0}, str(swapped))
    os.replace(swapped, os.path.join(step, "trainer_state.pt"))
    with pytest.raises(verified_io.Refused, match="trainer_state.pt differs from the SHA-256 digest"):
        verified_io.load_sealed(step, "trainer_state.pt")
    with pytest.raises(ConfigError, match="trainer_state.pt") as err:      # a resume's one line
        checkpointing.read_trainer_state(step)
    assert "\n" not in str(err.value)
    # the same bytes in a file others may write (another user's directory moved in): refused, not read
    shutil.copy(os.path.join(step, "rng", "rank_0.pt"), tmp_path / "open.pt")
    os.chmod(tmp_path / "open.pt", 0o664)
    os.replace(tmp_path / "open.pt", os.path.join(step, "rng", "rank_0.pt"))
    with pytest.raises(verified_io.Refused, match=r"rng/rank_0.pt is writable by group \(mode 664\)"):
        verified_io.load_sealed(step, "rng/rank_0.pt")
    # a link put in its place is not followed
    os.remove(os.path.join(step, "rng", "rank_0.pt"))
    os.symlink(os.path.join(step, "trainer_state.pt"), os.path.join(step, "rng", "rank_0.pt"))
    with pytest.raises(OSError):
        verified_io.load_sealed(step, "rng/rank_0.pt")


class OneTensor(cpu_compat.Boundary):
    """A role whose state is one (world, 4) tensor, a row per rank, saved and loaded by megatron's
    dist_checkpointing (torch_dist: a pickled `.metadata` and a `.distcp` per rank). `before_load`
    runs after megarl checked the step and before megatron reads it: where an attacker strikes. A
    cpu_compat.Boundary, as megarl's engine is: megatron's save calls CUDA functions on CPU."""

    def __init__(self, rank, world, value, before_load=None):
        self.rank, self.world, self.before_load = rank, world, before_load
        self.w = torch.full((1, 4), float(value + rank))

    def sharded(self):
        from megatron.core.dist_checkpointing import ShardedTensor
        return {"w": ShardedTensor.from_rank_offsets("w", self.w, (0, self.rank, self.world))}

    def save_checkpoint(self, path):
        from megatron.core import dist_checkpointing
        if self.rank == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        megatron_results_queue_in_process()
        dist_checkpointing.save(self.sharded(), path)

    def load_checkpoint(self, path):
        from megatron.core import dist_checkpointing
        if self.before_load:
            self.before_load()
        self.w = dist_checkpointing.load(self.sharded(), path)["w"]


def _swap_megatron_files(rank, world, root):
    """Two ranks save a real step (1.0, 2.0) and, beside it, another valid run (9.0, 10.0). Resuming
    from the first: (private) under a parent only this user can write, this user replaces megatron's
    `.metadata` and `.distcp` files after the check: read (only this user can, who could rewrite
    the manifest too); (open) under a parent anyone may write, the run directory is renamed away and
    the other run put in its place after the check: never read; (swapped file) a file changed before
    the check: refused; (their directory) a directory no longer this user's alone put in the run's
    place before the check: refused."""
    import shutil

    import tempfile

    import torch.distributed as dist
    tempfile.tempdir = None             # as a fresh process: TMPDIR (run_ranks' env) names the temporary directory
    # Resolved now, before the ranks meet: the first gettempdir() writes and removes a probe file
    # there, which the other rank's listing below would see if the two raced.
    tempfile.gettempdir()
    dist.init_process_group("gloo")
    out = {}
    for case, mode in (("private", 0o700), ("open", 0o777), ("swapped file", 0o777), ("their directory", 0o777)):
        parent = os.path.join(root, case.replace(" ", "_"))
        if rank == 0:
            os.makedirs(parent)
            os.chmod(parent, mode)             # not 0700 by umask: a parent open to every user
        dist.barrier()
        run, other = os.path.join(parent, "run"), os.path.join(parent, "other")
        checkpointing.save(other, 2, {"actor": OneTensor(rank, world, 9)}, {"step": 2, "world": world}, rank, None)
        checkpointing.save(run, 2, {"actor": OneTensor(rank, world, 1)}, {"step": 2, "world": world}, rank, None)
        step = os.path.join(run, "global_step_2")
        theirs, ours = (os.path.join(d, "global_step_2", "actor") for d in (other, run))

        def replace_files():
            if rank == 0:
                for name in os.listdir(theirs):
                    if name == ".metadata" or name.endswith(".distcp"):
                        shutil.copy(os.path.join(theirs, name), os.path.join(ours, name + ".new"))
                        os.replace(os.path.join(ours, name + ".new"), os.path.join(ours, name))
            dist.barrier()

        def replace_run():
            if case == "open":          # after the check, while megatron loads
                out["TMPDIR while loading"] = os.listdir(tempfile.gettempdir())
            if rank == 0:
                os.rename(run, run + ".away")
                os.rename(other, run)
                if case == "their directory":    # another user's: root gives it away, else opens it
                    for d, _, files in os.walk(run):
                        for p in [d] + [os.path.join(d, f) for f in files]:
                            os.chown(p, 4321, 4321) if os.geteuid() == 0 else os.chmod(p, 0o770)
            dist.barrier()
        said = []
        after = {"private": replace_files, "open": replace_run}.get(case)
        role = OneTensor(rank, world, 0, before_load=after)
        if case == "swapped file":
            replace_files()
        if case == "their directory":
            replace_run()
        try:
            checkpointing.load(step, {"actor": role}, rank, world, say=said.append)
            out[case] = (role.w.flatten().tolist(), said)
        except ConfigError as err:
            out[case] = str(err)
    return out


def test_megatron_files_swapped_after_the_check_are_never_read(tmp_path):
    tmp = tmp_path / "tmpdir"           # the step is read in place: not one byte goes to TMPDIR
    tmp.mkdir()
    results = run_ranks(2, _swap_megatron_files, (str(tmp_path),), env={"TMPDIR": str(tmp)})
    for rank, out in enumerate(results):
        assert out["TMPDIR while loading"] == [], out
        # open to others: the directory checked is what megatron reads; the one moved in is never read
        assert out["open"][0] == [1.0 + rank] * 4, out["open"]
        said = out["open"][1]
        assert len(said) == 1 and "is writable by group and others (mode 777), but the step is read only " \
                                  "through the directory checked, held open" in said[0], said
        # the control: this user's own swap inside the step is read (only this user could make it)
        assert out["private"][0] == [9.0 + rank] * 4, out["private"]
        said = out["private"][1]
        assert len(said) == 1 and "in place: only you can change it and the path to it" in said[0], said
        assert "cannot resume from global_step_2: actor/.metadata " in out["swapped file"], out   # size or digest
        whose = "is owned by uid 4321" if os.geteuid() == 0 else "is writable by group"
        assert f"(the run directory {tmp_path}/their_directory/run) {whose}" in out["their directory"], out
    assert os.listdir(tmp) == []


def _ranks_hold_different_steps(rank, world, root):
    """Rank 1 opens another (valid, sealed) step directory at the same path, as a rename above the
    run directory between the two ranks' opens would give it: the ranks' inodes differ, refused."""
    import torch.distributed as dist

    from megarl.trainer.checkpoints import staging
    dist.init_process_group("gloo")
    steps = [os.path.join(root, name, "global_step_2") for name in ("a", "b")]
    if rank == 1:
        real = staging._hold
        staging._hold = lambda path: real(steps[1])
    try:
        with staging.checked_step(steps[0], ["rng"]):
            return "read"
    except verified_io.Refused as err:
        return str(err)


def test_ranks_that_opened_different_directories_are_refused(tmp_path):
    for name in ("a", "b"):
        sealed_step(tmp_path / name)
    for got in run_ranks(2, _ranks_hold_different_steps, (str(tmp_path),)):
        assert got.startswith(f"({tmp_path}/a/global_step_2) was replaced by another directory while the ranks "
                              "opened it"), got
