"""megarl/rollout/vllm/shm.py without vLLM: a TP group's shared-memory objects that no process
has mapped are removed before vLLM starts; mapped ones, other groups' and other names stay."""
import mmap
import os

from megarl.rollout.vllm.shm import clear_stale, group_pattern, mapped_paths


def test_stale_objects_of_the_group_are_removed_and_mapped_ones_kept(tmp_path):
    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "x-tp:0-[0-1]-cpushm_2", "-tp:0-[2-3]-cpushm_0",
             "-tp:0-[0-1]-other"]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    assert group_pattern([0, 1], str(tmp_path)).endswith("*-[[]0-1]-cpushm_*")
    with open(tmp_path / names[2], "r+b") as f, mmap.mmap(f.fileno(), 4096) as held:   # a live run's
        assert str(tmp_path / names[2]) in mapped_paths(str(tmp_path))
        removed = clear_stale([0, 1], str(tmp_path))
        held[0] = 1
    assert removed == [str(tmp_path / n) for n in names[:2]]
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
    assert clear_stale([4, 5], str(tmp_path)) == []
    # once the run that held it is gone, it is stale too
    assert clear_stale([0, 1], str(tmp_path)) == [str(tmp_path / names[2])]
