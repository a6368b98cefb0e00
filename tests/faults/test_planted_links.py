"""Files megarl writes outside its private run directory cannot be steered by a link another user
plants: generation dumps (trainer.rollout_data_dir / validation_data_dir), a trainer.log_dir's
val_generations.jsonl and TensorBoard directory (megarl/storage/private_out.py).

    python -m pytest -q tests/faults/test_planted_links.py
"""
from __future__ import annotations

import os
import re
import stat

import pytest

from megarl.config import ConfigError
from megarl.storage.private_out import check_output_dir, new_file, open_append
from megarl.trainer.metrics.generations import Generations, write_jsonl
from megarl.trainer.metrics.logger import MetricsLogger

OTHER_UID = 4242          # a user that is not this one (needs root to give a file to it)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def victim(tmp_path) -> str:
    """A file the run's owner can write and an attacker wants overwritten."""
    path = tmp_path / "victim"
    path.write_text("keep me\n")
    return str(path)


def dump_dir(tmp_path, name="dumps") -> str:
    path = tmp_path / name
    path.mkdir(mode=0o700)
    return str(path)


def one_sample() -> Generations:
    return Generations(["1+1="], ["2"], ["2"], [1.0], {"acc": [1.0]})


def test_a_planted_tmp_link_is_not_written_through(tmp_path):
    d, target = dump_dir(tmp_path), victim(tmp_path)
    os.symlink(target, os.path.join(d, "3.jsonl.tmp"))      # a predictable temporary name a writer might use
    os.symlink(target, os.path.join(d, "3.jsonl"))          # and the name it ends as
    path = write_jsonl(d, 3, one_sample())
    assert open(target).read() == "keep me\n"               # not overwritten
    assert not os.path.islink(path) and stat.S_ISREG(os.lstat(path).st_mode)   # a link replaced, not followed
    assert '"output": "2"' in open(path).read() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(d)) == ["3.jsonl", "3.jsonl.tmp"]    # no private temp file left behind


def test_a_failed_write_leaves_neither_half_a_file_nor_its_temp(tmp_path):
    d = dump_dir(tmp_path)
    with pytest.raises(RuntimeError), new_file(d, "1.jsonl") as f:
        f.write("half")
        raise RuntimeError("disk gone")
    assert os.listdir(d) == []


@pytest.mark.parametrize("mode,words", [(0o770, "writable by group (mode 770)"),
                                        (0o1777, "writable by group and others (mode 1777)")])
def test_a_dump_directory_others_can_write_is_refused(tmp_path, mode, words):
    d = dump_dir(tmp_path)
    os.chmod(d, mode)
    with pytest.raises(ConfigError, match=r"trainer.validation_data_dir: .*" + re.escape(words)) as err:
        write_jsonl(d, 1, one_sample(), "trainer.validation_data_dir")
    assert "\n" not in str(err.value) and os.listdir(d) == []


def test_a_missing_dump_directory_is_made_private(tmp_path):
    d = str(tmp_path / "new" / "dumps")
    write_jsonl(d, 1, one_sample())
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and os.listdir(d) == ["1.jsonl"]


def test_a_link_to_a_directory_of_ones_own_is_followed(tmp_path):
    """A user's own link (to a bigger disk, say) keeps working."""
    real = dump_dir(tmp_path, "real")
    os.symlink(real, tmp_path / "mine")
    write_jsonl(str(tmp_path / "mine"), 2, one_sample())
    assert os.listdir(real) == ["2.jsonl"]


@as_root
def test_a_directory_or_link_of_another_user_is_refused(tmp_path):
    d = dump_dir(tmp_path)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"is owned by uid {OTHER_UID}, not by this user"):
        write_jsonl(d, 1, one_sample())
    # a link planted where the dump directory will be made, to a directory of this user's
    mine = dump_dir(tmp_path, "mine")
    planted = tmp_path / "planted"
    os.symlink(mine, planted)
    os.lchown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"is a symbolic link made by uid {OTHER_UID}"):
        write_jsonl(str(planted), 1, one_sample())
    assert os.listdir(mine) == []


def test_val_generations_does_not_append_through_a_link(tmp_path):
    log_dir, target = dump_dir(tmp_path, "logs"), victim(tmp_path)
    os.symlink(target, os.path.join(log_dir, "val_generations.jsonl"))
    log = MetricsLogger(log_dir, ["console"], "p", "e")
    with pytest.raises(ConfigError, match="val_generations.jsonl is a symbolic link"):
        log.log_generations(1, [("1+1=", "2", 1.0)])
    assert open(target).read() == "keep me\n"
    os.unlink(os.path.join(log_dir, "val_generations.jsonl"))
    log.log_generations(1, [("1+1=", "2", 1.0)])                  # the control: a plain file of its own
    log.log_generations(2, [("1+2=", "3", 0.0)])
    lines = open(os.path.join(log_dir, "val_generations.jsonl")).read().splitlines()
    assert len(lines) == 2 and '"step": 2' in lines[1]
    assert stat.S_IMODE(os.stat(os.path.join(log_dir, "val_generations.jsonl")).st_mode) == 0o600


def test_append_refuses_a_second_name_for_a_file(tmp_path):
    """A hard link: the file has another name somewhere, which the append would write into."""
    target = victim(tmp_path)
    os.link(target, tmp_path / "val_generations.jsonl")
    with pytest.raises(ConfigError, match="2 links"):
        open_append(str(tmp_path / "val_generations.jsonl"), "trainer.log_dir")
    assert open(target).read() == "keep me\n"


def test_tensorboards_directory_is_checked_as_the_run_directory(tmp_path):
    pytest.importorskip("tensorboard")
    log_dir = dump_dir(tmp_path, "logs")
    board = os.path.join(log_dir, "tensorboard")
    os.mkdir(board)
    os.chmod(board, 0o777)
    with pytest.raises(ConfigError, match="tensorboard is writable by others"):
        MetricsLogger(log_dir, ["tensorboard"], "p", "e")
    os.chmod(board, 0o700)
    MetricsLogger(log_dir, ["tensorboard"], "p", "e").close()


def test_check_output_dir_says_what_it_cannot_create(tmp_path):
    (tmp_path / "a_file").write_text("")
    words = r"trainer.rollout_data_dir: cannot create .*a_file/d \(Not a directory\)"
    with pytest.raises(ConfigError, match=words) as err:
        check_output_dir(str(tmp_path / "a_file" / "d"), "trainer.rollout_data_dir")
    assert "\n" not in str(err.value)


def test_the_preflight_refuses_a_dump_directory_others_can_write(tmp_path):
    """Said before any rank starts, not after the first step's dump."""
    from megarl.experiment import load_config
    from megarl.launcher.preflight_run import check_output_paths
    d = dump_dir(tmp_path)
    os.chmod(d, 0o777)
    cfg = load_config(None, [f"trainer.rollout_data_dir={d}", f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"trainer.rollout_data_dir: .*dumps is writable by group and others"):
        check_output_paths(cfg)
    os.chmod(d, 0o700)
    check_output_paths(cfg)                                   # the control
