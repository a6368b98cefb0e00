"""Chains of `base:` files: each file read once however often it is listed, the chain's depth, file
count and bytes bounded, every refusal one line naming the chain; a `${section}` reference copies
the section with its own references resolved.

    python -m pytest -q tests/test_config_bases.py
"""
from __future__ import annotations

import os

import pytest

import megarl.config.loader as loader
from megarl.config import ConfigError
from megarl.config.interpolate import resolve
from megarl.config.loader import MAX_BASE_DEPTH, MAX_BASE_FILES, read_yaml
from megarl.experiment import load_config


@pytest.fixture
def parses(monkeypatch):
    """The files parsed, in order."""
    seen: list[str] = []
    real = loader._parse

    def counting(path):
        seen.append(os.path.basename(path))
        return real(path)
    monkeypatch.setattr(loader, "_parse", counting)
    return seen


def doubled_chain(tmp_path, levels: int) -> str:
    """c0.yaml lists c1.yaml twice, c1 lists c2 twice, ...: 2**levels reads without a cache."""
    for k in range(levels):
        (tmp_path / f"c{k}.yaml").write_text(f"base: [c{k + 1}.yaml, c{k + 1}.yaml]\ntrainer: {{seed: {k}}}\n")
    (tmp_path / f"c{levels}.yaml").write_text("trainer: {save_freq: 3}\n")
    return str(tmp_path / "c0.yaml")


def test_a_file_listed_twice_at_every_level_is_read_once(tmp_path, parses):
    top = doubled_chain(tmp_path, MAX_BASE_DEPTH - 1)                 # 2**31 reads without the cache
    assert read_yaml(top)["trainer"] == {"seed": 0, "save_freq": 3}
    assert sorted(parses) == sorted(f"c{k}.yaml" for k in range(MAX_BASE_DEPTH))
    # through load_config too: the bootstrap's own-path search walks the same chain once
    cfg = load_config(top)
    assert cfg.trainer.seed == 0 and cfg.trainer.save_freq == 3


def test_a_chain_40_deep_is_refused_naming_it(tmp_path, parses):
    top = doubled_chain(tmp_path, 40)
    with pytest.raises(ConfigError) as err:
        read_yaml(top)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{top}: config bases nest over {MAX_BASE_DEPTH} levels (c0.yaml -> "
                                                "c1.yaml -> c2.yaml -> ... -> c31.yaml -> c32.yaml); flatten"), line
    assert len(parses) == MAX_BASE_DEPTH                 # c32.yaml is named, not read


def test_a_chain_of_1200_bases_is_refused_as_a_chain_not_as_deep_yaml(tmp_path):
    for k in range(1200):
        (tmp_path / f"b{k}.yaml").write_text(f"base: b{k + 1}.yaml\n")
    (tmp_path / "b1200.yaml").write_text("trainer: {seed: 1}\n")
    with pytest.raises(ConfigError, match=r"config bases nest over 32 levels \(b0.yaml -> b1.yaml") as err:
        read_yaml(str(tmp_path / "b0.yaml"))
    assert "YAML nests" not in str(err.value)


def test_too_many_files_or_bytes_are_refused(tmp_path):
    names = [f"f{k}.yaml" for k in range(MAX_BASE_FILES + 1)]
    for name in names:
        (tmp_path / name).write_text("trainer: {seed: 1}\n")
    (tmp_path / "wide.yaml").write_text(f"base: [{', '.join(names)}]\n")
    with pytest.raises(ConfigError, match=f"config bases name over {MAX_BASE_FILES} files"):
        read_yaml(str(tmp_path / "wide.yaml"))
    big = "trainer:\n" + "".join(f"  k{i}: {'x' * 80}\n" for i in range(9000))   # ~0.8 MiB of keys each
    for k in range(3):
        (tmp_path / f"big{k}.yaml").write_text(big)
    (tmp_path / "heavy.yaml").write_text("base: [big0.yaml, big1.yaml, big2.yaml]\n")
    with pytest.raises(ConfigError, match=r"config bases hold over 2 MiB together \(heavy.yaml -> big2.yaml\)"):
        read_yaml(str(tmp_path / "heavy.yaml"))


def test_a_cycle_and_a_diamond(tmp_path, parses):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"config bases form a cycle \(a.yaml -> b.yaml -> a.yaml\)"):
        read_yaml(str(tmp_path / "a.yaml"))
    # top lists left and right, both built on common: common is read once, merged in order
    (tmp_path / "common.yaml").write_text("trainer: {seed: 1, save_freq: 1, test_freq: 1}\n")
    (tmp_path / "left.yaml").write_text("base: common.yaml\ntrainer: {save_freq: 2}\n")
    (tmp_path / "right.yaml").write_text("base: common.yaml\ntrainer: {test_freq: 3}\n")
    (tmp_path / "top.yaml").write_text("base: [left.yaml, right.yaml]\ntrainer: {seed: 4}\n")
    parses.clear()
    assert read_yaml(str(tmp_path / "top.yaml"))["trainer"] == {"seed": 4, "save_freq": 1, "test_freq": 3}
    assert sorted(parses) == ["common.yaml", "left.yaml", "right.yaml", "top.yaml"]


def test_a_section_reference_copies_the_section_resolved():
    tree = {"trainer": {"seed": 7, "name": "run"},
            "a": {"seed": "${trainer.seed}", "tag": "${trainer.name}-x", "inner": {"up": "${..seed}"},
                  "l": ["${.seed}"]},
            "b": "${a}"}
    out = resolve(tree)
    assert out["b"] == {"seed": 7, "tag": "run-x", "inner": {"up": 7}, "l": [7]}
    assert out["a"] == out["b"]
    with pytest.raises(ConfigError, match=r"references form a cycle: a -> a"):
        resolve({"a": {"x": "${a}"}})


def test_a_section_reference_through_load_config(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "trainer: {total_training_steps: 9}\n"
        "actor_rollout_ref: {actor: {optim: {lr: 3.0e-6, total_training_steps: '${trainer.total_training_steps}'}}}\n"
        "critic: {optim: '${actor_rollout_ref.actor.optim}'}\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert cfg.critic.optim.lr == 3.0e-6 and cfg.critic.optim.total_training_steps == 9
