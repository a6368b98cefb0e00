"""Every file of a step checkpoint truncated or deleted, one at a time: the resume stops with one
line naming the step and the file, and writes nothing (the checkpoint's other files, the pointer
and the run directory are unchanged).

In-process over 2 real gloo ranks with the real actor (megatron TP 2) for the 2 x 11 cases, plus
one real `megarl-train` resume on a truncated .distcp: its whole output has the one line and no
traceback (torch's CheckpointException, a BaseException, would print 260 lines)."""
import hashlib
import os
import re
import shutil

import pytest

from tests.distributed import run_ranks
from tests.faults.conftest import STEPS
from tests.faults.runs import Launch, overrides

# the files the resume reads; hf/ tokenizer files are only read by checkpoints_tools/
READ = ["manifest.json", "trainer_state.pt", "rng/rank_0.pt", "rng/rank_1.pt", "actor/metadata.json", "actor/common.pt",
        "actor/.metadata", "actor/__0_0.distcp", "actor/__0_1.distcp", "actor/__1_0.distcp", "actor/__1_1.distcp",
        "actor/hf/config.json"]


def _digests(root):
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _try_each(rank, world, model_dir, run_dir, step_dir):
    import torch.distributed as dist

    from megarl.config import ConfigError
    from megarl.experiment import load_config
    from megarl.trainer.checkpoints import checkpointing
    from megarl.job.ranks import setup_ranks
    from megarl.workers.actor import ActorWorker

    cfg = load_config("configs/quickstart.yaml", overrides(model_dir, run_dir, STEPS))
    ranks = setup_ranks(cfg)
    actor = ActorWorker.from_config(cfg)
    results = {}
    for rel in READ:
        for how in ("truncate", "delete"):
            path = os.path.join(step_dir, rel)
            if rank == 0:
                shutil.copyfile(path, path + ".keep")
                before = _digests(run_dir)
                if how == "truncate":
                    os.truncate(path, os.path.getsize(path) // 2)
                else:
                    os.remove(path)
            dist.barrier()
            try:
                checkpointing.load(step_dir, {"actor": actor}, ranks.rank, ranks.world)
                message = None
            except ConfigError as err:
                message = str(err)
            dist.barrier()
            if rank == 0:
                after = _digests(run_dir)
                changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)
                                 and k not in (os.path.relpath(path, run_dir),
                                               os.path.relpath(path, run_dir) + ".keep"))
                os.replace(path + ".keep", path)
                results[(rel, how)] = (message, changed)
            else:
                results[(rel, how)] = (message, [])
            dist.barrier()
    checkpointing.load(step_dir, {"actor": actor}, ranks.rank, ranks.world)   # intact again: loads
    return results


@pytest.mark.timeout(900)
def test_every_checkpoint_file_damaged(sync_reference, addition_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(sync_reference["dir"] / "global_step_4", run_dir / "global_step_4")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("4")
    step_dir = str(run_dir / "global_step_4")
    assert sorted(READ) == sorted(os.path.relpath(os.path.join(b, f), step_dir) for b, _, fs in os.walk(step_dir)
                                  for f in fs if "/hf/" not in os.path.join(b, f) or f == "config.json")
    per_rank = run_ranks(2, _try_each, (addition_model_dir, str(run_dir), step_dir))
    for key in per_rank[0]:
        rel, how = key
        for rank in (0, 1):
            message, changed = per_rank[rank][key]
            assert message is not None, f"{key}: rank {rank} loaded a damaged checkpoint"
            assert "\n" not in message and "cannot resume from global_step_4: " in message and rel in message, \
                (key, message)
            assert changed == [], (key, changed)


@pytest.mark.timeout(300)
def test_truncated_shard_is_one_line_at_the_command_line(sync_reference, addition_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(sync_reference["dir"], run_dir, ignore=shutil.ignore_patterns("logs", ".megarl.lock"))
    shard = run_dir / f"global_step_{STEPS}" / "actor" / "__1_0.distcp"
    os.truncate(shard, 1000)
    before = _digests(run_dir)
    rc, out = Launch(overrides(addition_model_dir, run_dir, STEPS + 1)).finish()
    assert rc != 0
    lines = [line for line in out.splitlines() if "cannot resume from" in line]
    # the line comes from whichever rank reports first ("megarl: rank 1: config error: ..." from rank 1)
    refusal = re.compile(r"megarl: (rank \d+: )?config error: ")
    assert lines and refusal.match(lines[0]) and (f"trainer.resume_mode: cannot resume from global_step_{STEPS}: "
                                                  in lines[0]) and "actor/__1_0.distcp" in lines[0], out[-3000:]
    assert sum(bool(refusal.match(line)) for line in out.splitlines()) == 1, out[-3000:]
    # no traceback of megarl's or torch's checkpoint reader (torchrun still prints its own summary)
    assert "megarl/trainer" not in out and "CheckpointException" not in out and "EOFError" not in out, out[-3000:]
    after = _digests(run_dir)
    # the checkpoints, the pointer, metrics.jsonl and the run's config.yaml / command.json untouched (a
    # launch writes those only once its resume has succeeded; this one asked for another step count)
    run_record = ("logs/", ".megarl.lock")
    assert {k: v for k, v in after.items() if not k.startswith(run_record)} == \
        {k: v for k, v in before.items() if not k.startswith(run_record)}
