"""Step checkpoints without megatron: atomic rename, pointer file, pruning, partial saves."""
import os

import pytest
import torch

from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.trainer.checkpoints import checkpointing as ck


class Role:
    def __init__(self, fail=False):
        self.fail = fail

    def save_checkpoint(self, path):
        os.makedirs(path)
        torch.save({"w": torch.ones(2)}, os.path.join(path, "w.pt"))
        if self.fail:
            raise RuntimeError("disk full")

    def load_checkpoint(self, path):
        self.loaded = torch.load(os.path.join(path, "w.pt"))


def test_save_prune_and_interrupted_save(tmp_path):
    root = str(tmp_path)
    for step in (2, 4, 6):
        ck.save(root, step, {"actor": Role()}, {"step": step, "world": 1}, rank=0, keep=2)
    assert ck.complete_steps(root) == [4, 6] and ck.latest_step_dir(root).endswith("global_step_6")
    with pytest.raises(RuntimeError, match="disk full"):
        ck.save(root, 8, {"actor": Role(fail=True)}, {"step": 8, "world": 1}, rank=0, keep=2)
    # Killed mid-save: the partial directory is not a checkpoint; the pointer still says 6.
    assert os.path.isdir(os.path.join(root, "global_step_8.tmp"))
    assert ck.latest_step_dir(root).endswith("global_step_6")
    assert ck.clean_partial(root) == ["global_step_8.tmp"]
    role = Role()
    state = ck.load(ck.latest_step_dir(root), {"actor": role}, rank=0, world=1)
    assert state["step"] == 6 and torch.equal(role.loaded["w"], torch.ones(2))


def test_stale_pointer_falls_back_and_rng_roundtrip(tmp_path):
    root = str(tmp_path)
    ck.save(root, 3, {}, {"step": 3, "world": 1}, rank=0, keep=None)
    with open(os.path.join(root, ck.POINTER), "w") as f:
        f.write("99")                                      # points at nothing complete
    assert ck.latest_step_dir(root).endswith("global_step_3")
    torch.manual_seed(0)
    state = ck.rng_state()
    a = torch.rand(3)
    ck.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def test_a_resume_at_another_world_size_says_the_random_streams_are_not_restored(tmp_path):
    root = str(tmp_path)
    ck.save(root, 3, {}, {"step": 3, "world": 1}, rank=0, keep=None)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    state = ck.load(ck.latest_step_dir(root), {}, rank=1, world=2)     # rank 1 has no rng file: not read
    assert torch.equal(torch.get_rng_state(), before)
    notice = ck.rng_notice(state, 2)
    assert "saved by 1 ranks and this run has 2" in notice and "random streams are not" in notice
    assert ck.rng_notice(state, 1) is None


def test_resume_modes(tmp_path):
    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path}"])
    assert ck.resume_dir(cfg) is None
    ck.save(str(tmp_path), 5, {}, {"step": 5, "world": 1}, rank=0, keep=None)
    assert ck.resume_dir(cfg).endswith("global_step_5")
    cfg = load_config(None, [f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=disable"])
    assert ck.resume_dir(cfg) is None
    cfg = load_config(None, ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/nothing"])
    with pytest.raises(ConfigError, match="not a complete megarl step checkpoint"):
        ck.resume_dir(cfg)


def _save_failing_on_rank_1(rank, world, root):
    """Two gloo ranks save steps 2 and 4; at step 4 only rank 1's part fails, once in megarl's own
    files (the fault hook's ENOSPC) and once in seal's hashing (EIO): both ranks must stop with the
    same one-line error naming rank 1, rank 0 removing the partial save."""
    import errno

    import torch.distributed as dist

    from megarl.trainer.checkpoints import verified_io
    dist.init_process_group("gloo")
    ck.save(root, 2, {}, {"step": 2, "world": world}, rank=rank, keep=None)
    seen = []
    os.environ["MEGARL_FAULT"] = "enospc@save:4:1"
    try:
        ck.save(root, 4, {}, {"step": 4, "world": world}, rank=rank, keep=None)
    except ck.CheckpointSaveError as err:
        seen.append(str(err))
    del os.environ["MEGARL_FAULT"]
    real_digest = verified_io._digest

    def failing_digest(path, sync=False):
        raise OSError(errno.EIO, "Input/output error", path)
    if rank == 1:
        verified_io._digest = failing_digest
    try:
        ck.save(root, 4, {}, {"step": 4, "world": world}, rank=rank, keep=None)
    except ck.CheckpointSaveError as err:
        seen.append(str(err))
    verified_io._digest = real_digest
    dist.barrier()
    return seen, sorted(os.listdir(root))


def test_a_save_failing_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    from tests.distributed import run_ranks
    results = run_ranks(2, _save_failing_on_rank_1, (str(tmp_path),))
    for seen, listing in results:
        assert len(seen) == 2, seen
        assert seen[0].startswith("saving step 4 failed on rank 1: No space left on device"), seen[0]
        assert seen[1].startswith("saving step 4 failed on rank 1: Input/output error"), seen[1]
        assert all("the last complete checkpoint is " + str(tmp_path / "global_step_2") in s for s in seen)
        assert "global_step_4" not in listing and "global_step_4.tmp" not in listing, listing
    assert (tmp_path / ck.POINTER).read_text() == "2"


class Unloadable(Role):
    def __init__(self, err):
        super().__init__()
        self.err = err

    def load_checkpoint(self, path):
        raise self.err


def test_a_verified_step_that_fails_to_load_is_not_called_damaged(tmp_path):
    """Every byte a role reads was checked against the manifest first, so a role that cannot load
    it meets a version or a bug, not damage: the line says the files are intact, the traceback goes
    to the run's log (ConfigError.detail, printed after the line, which ends the console's copy);
    a checkpoint that is whole but another role's (LoRA, head, vocabulary) keeps its own fix."""
    from megarl.workers.checkpoint import CheckpointMismatch

    root = str(tmp_path)
    ck.save(root, 2, {"actor": Role()}, {"step": 2, "world": 1}, rank=0, keep=2)
    step = ck.latest_step_dir(root)
    with pytest.raises(ConfigError) as err:
        ck.load(step, {"actor": Unloadable(KeyError("step"))}, rank=0, world=1)
    line = str(err.value)
    assert "\n" not in line and "damaged" not in line, line
    assert line.startswith("trainer.resume_mode: cannot resume from global_step_2: actor matches the step's "
                           "manifest"), line
    assert "(KeyError: 'step')" in line and "trainer.resume_mode=disable" in line, line
    assert err.value.detail.startswith("Traceback") and "KeyError: 'step'" in err.value.detail
    assert "load_checkpoint" in err.value.detail                  # the frame that failed
    with pytest.raises(ConfigError) as err:
        ck.load(step, {"actor": Unloadable(CheckpointMismatch("x: saved with LoRA None; set lora_rank"))},
                rank=0, world=1)
    assert str(err.value) == ("trainer.resume_mode: cannot resume from global_step_2: actor: x: saved with LoRA "
                              "None; set lora_rank") and err.value.detail is None
