"""Bypass mode (verl's algorithm.rollout_correction.bypass_mode): the rollout's log-probs stand for the
old policy's and the actor's old-log-prob pass is skipped where that changes nothing.

    python -m pytest -q tests/test_bypass.py

- two real runs (`python -m megarl.train`, TP 1, the built-in engine at fp32), one skipping the pass
  (the default there) and one not: the same losses, gradient norms, rewards, mismatch metrics;
- where it cannot be honest, bypass_mode=true is refused in one line (exit 2), and null resolves off;
- the mismatch metrics come from the first mini-batch of the update, forwarded before any step.
"""
import subprocess
import sys

import pytest
import torch

from megarl.algos.loss_fn import make_actor_loss_fn
from megarl.config import ConfigError
from megarl.experiment import load_config
from megarl.protocol import DataProto
from megarl.trainer.loop.bypass import Bypass, resolve_bypass
from megarl.trainer.metrics.logger import read_metrics
from tests.helpers.training_runs import finish, train

CPU = torch.device("cpu")
KEY = "algorithm.rollout_correction.bypass_mode"
DISAGG = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.placement=disaggregated",
          "actor_rollout_ref.rollout.disaggregated_ranks=1",
          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
          "algorithm.filter_groups.enable=false"]


def cfg(*over):
    return load_config("configs/quickstart.yaml", list(over))


def test_true_is_refused_where_it_cannot_be_honest():
    for over, words in (([f"{KEY}=true", *DISAGG], "older weights"),
                        ([f"{KEY}=true", "algorithm.rollout_correction.rollout_is=token"], "IS weights"),
                        ([f"{KEY}=true", "actor_rollout_ref.rollout.name=hf"], "bypass_tolerance"),
                        ([f"{KEY}=true", "actor_rollout_ref.rollout.dtype=bfloat16"], "bypass_tolerance"),
                        ([f"{KEY}=true", "algorithm.rollout_correction.loss_type=reinforce"], "loss_type")):
        with pytest.raises(ConfigError, match=words):
            cfg(*over)
    # an accepted tolerance lets another engine bypass, checked every step
    c = cfg(f"{KEY}=true", "actor_rollout_ref.rollout.name=hf", "algorithm.rollout_correction.bypass_tolerance=0.01")
    b = resolve_bypass(c, CPU)
    assert b.on and b.explicit and b.tolerance == 0.01
    # as users see it: one line, exit code 2, before anything starts
    proc = subprocess.run([sys.executable, "-m", "megarl.train", "--config", "configs/quickstart.yaml",
                           "--print-config", f"{KEY}=true", "actor_rollout_ref.rollout.name=hf"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and KEY in lines[0] and "bypass_tolerance" in lines[0], proc.stderr


def test_null_is_on_only_where_the_rollout_log_probs_are_the_trainers():
    assert resolve_bypass(cfg(), CPU).on                                    # native, fp32 on CPU, sync loop
    for over, device, words in (([], torch.device("cuda"), "engine at this precision"),     # auto: bf16 on GPU
                                (["actor_rollout_ref.rollout.name=hf"], CPU, "hf engine"),
                                (DISAGG, CPU, "older weights"),
                                (["algorithm.rollout_correction.rollout_is=token"], CPU, "rollout_is"),
                                ([f"{KEY}=false"], CPU, "bypass_mode=false")):
        b = resolve_bypass(cfg(*over), device)
        assert not b.on and words in b.reason, (over, b.reason)


def test_a_gap_above_the_tolerance_stops_true_and_turns_null_off():
    gap = {"rollout_corr/max_abs_log_prob_diff": 0.5}
    with pytest.raises(RuntimeError, match="bypass_mode=true"):
        Bypass(True, True, 0.01, "").check(gap, 3)
    auto = Bypass(True, False, 1e-3, "")
    with pytest.warns(UserWarning, match="old-log-prob pass runs again"):
        auto.check(gap, 3)
    assert not auto.on
    fine = Bypass(True, False, 1e-3, "")
    fine.check({"rollout_corr/max_abs_log_prob_diff": 1e-6}, 4)
    assert fine.on


def test_the_loss_measures_the_mismatch_on_the_first_mini_batch_only():
    c = cfg("data.max_response_length=4")
    loss_fn = make_actor_loss_fn(c, mismatch_rows=4)
    g = torch.Generator().manual_seed(0)

    def micro(rows=2):
        roll = -torch.rand(rows, 4, generator=g)
        return DataProto.from_dict({"old_log_probs": roll, "rollout_log_probs": roll,
                                    "advantages": torch.randn(rows, 4), "response_mask": torch.ones(rows, 4)},
                                   meta_info={"global_tokens": 16.0})

    for _ in range(2):                     # two updates: the counter restarts at each
        loss_fn.start_update()
        got = []
        for _ in range(4):                 # 4 micro-batches of 2 rows: mini-batches of 4 rows
            mb = micro()
            logp = mb.batch["rollout_log_probs"] + 0.01
            got.append(loss_fn({"log_probs": logp.requires_grad_()}, mb)[1])
        assert ["rollout_corr/max_abs_log_prob_diff" in m for m in got] == [True, True, False, False]
        assert got[0]["rollout_corr/max_abs_log_prob_diff"] == pytest.approx(0.01, rel=1e-4)
    assert not any("rollout_corr/kl" in m for m in [make_actor_loss_fn(c)({"log_probs": micro().batch["old_log_probs"]},
                                                                            micro())[1]])


@pytest.mark.timeout(900)
def test_skipping_the_pass_trains_exactly_as_computing_it(addition_model_dir, tmp_path):
    """Same seeds, two steps of two mini-batches each (so the second mini-batch runs on updated
    weights against the old policy's log-probs); one run skips the pass (null: on here), one computes it."""
    # Two one-process runs side by side: each keeps one core of a 2-core machine busy.
    procs = {}
    for name, extra in (("skip", []), ("pass", [f"{KEY}=false"])):
        procs[name] = train([f"actor_rollout_ref.model.path={addition_model_dir}",
                              f"trainer.default_local_dir={tmp_path / name}",
                              "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1",
                              "trainer.n_gpus_per_node=1",
                              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                              "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                              "algorithm.filter_groups.enable=false", *extra])
    runs = {}
    for name, proc in procs.items():
        code, out = finish(proc)
        assert code == 0, out[-3000:]
        runs[name] = (read_metrics(str(tmp_path / name))[1:], out)
    (skip, skip_out), (full, full_out) = runs["skip"], runs["pass"]
    assert "bypass on: built-in engine at fp32" in skip_out and "bypass off (bypass_mode=false)" in full_out
    for a, b in zip(skip, full):
        assert a["rollout_corr/bypass_mode"] == 1.0 and "rollout_corr/bypass_mode" not in b
        assert a["timing_s/old_log_prob"] == 0.0 < b["timing_s/old_log_prob"]        # the pass did not run
        assert a["critic/score/mean"] == b["critic/score/mean"]                           # the same samples
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # measured on the first mini-batch vs the whole batch: both at fp32 rounding
        assert a["rollout_corr/max_abs_log_prob_diff"] < 1e-4 and b["rollout_corr/max_abs_log_prob_diff"] < 1e-4


def test_r2_keeps_the_pass_it_records_routes_in():
    """R2 records the routes in the old-log-prob pass: true is refused, null keeps the pass."""

    def moe(*over):
        return load_config("configs/grpo_moe_tiny.yaml", ["actor_rollout_ref.actor.router_replay.mode=R2", *over])

    with pytest.raises(ConfigError, match="router_replay.mode=R2"):
        moe(f"{KEY}=true")
    b = resolve_bypass(moe(), CPU)
    assert not b.on and "R2" in b.reason, b.reason
