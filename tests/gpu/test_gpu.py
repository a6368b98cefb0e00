"""The GPU path, end to end, wherever CUDA is visible; skipped elsewhere (CI is CPU).

    python -m pytest -q tests/gpu                       # or: python benchmarks/gpu_check.py
    MEGARL_GPU_REPORT=dir python -m pytest -q tests/gpu   # also writes each test's figures as dir/<test>.json

The worker checks are the very functions the CPU suite runs over gloo (tests/helpers/worker_checks.py,
tests/test_gpu_path.py); the trainer runs reuse tests/test_trainer_e2e.py's command line, with
the device keys a GPU user types (trainer.device=cuda, trainer.n_gpus_per_node, actor TP).
"""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from megarl.trainer.metrics.logger import read_metrics
from tests.distributed import run_ranks
from tests.helpers.training_runs import finish, kill_tree, overrides, stable, train
from tests.helpers.worker_checks import check_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: torch.cuda.is_available() is False (CI runs on CPU)")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [1, 2]
# bf16 trainer vs bf16 engine on the same weights: the per-step mismatch the trainer logs
K3_KL_BOUND, PROB_DIFF_BOUND = 1e-2, 2e-2


def report(name: str, data) -> None:
    root = os.environ.get("MEGARL_GPU_REPORT")
    if root:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)


def need(world: int) -> None:
    if world > GPUS:
        pytest.skip(f"needs {world} GPUs, {GPUS} visible")


def on_gpus(world: int, *extra) -> list[str]:
    """The quickstart on `world` GPUs: actor TP = world (TP 1 at one GPU), DP 1."""
    return ["trainer.device=cuda", f"trainer.n_gpus_per_node={world}",
            f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={world}", *extra]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("tiny") / "m"), "qwen2", seed=5, tokenizer=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", WORLDS)
def test_workers_offload_and_weight_sync(tiny, world):
    need(world)
    got = run_ranks(world, check_all, (tiny, "cuda"))
    report(f"workers_w{world}", got[0])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_grpo_quickstart(addition_model_dir, tmp_path, world):
    need(world)
    run = tmp_path / "grpo"
    code, out = finish(train(overrides(addition_model_dir, run, *on_gpus(world))))
    assert code == 0, out[-4000:]
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    steps = rows[1:]
    for key in ("actor/pg_loss", "perf/mfu/actor", "perf/mfu/compute_log_prob", "memory/gen_peak_gb",
                "memory/update_actor_peak_gb", "rollout_corr/k3_kl"):
        assert all(key in r for r in steps), key
    assert all(0 < r["perf/mfu/actor"] < 1 for r in steps)
    assert "Expected all tensors to be on the same device" not in out
    mism = {k: max(r[k] for r in steps) for k in ("rollout_corr/k3_kl", "training/rollout_probs_diff_mean",
                                                 "rollout_corr/max_abs_log_prob_diff")}
    report(f"grpo_w{world}", {"mismatch_max_over_steps": mism, "last_step": steps[-1], "warnings":
                              [line for line in out.splitlines() if "Warning" in line][:40]})
    assert mism["rollout_corr/k3_kl"] < K3_KL_BOUND and mism["training/rollout_probs_diff_mean"] < PROB_DIFF_BOUND, mism


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_ppo_with_critic_and_offload(addition_model_dir, tmp_path, world):
    """PPO (GAE, critic, KL loss with a reference) with every offload key on: the roles' state leaves
    the GPU around each rollout and the run trains as usual."""
    need(world)
    run = tmp_path / "ppo"
    off = [f"actor_rollout_ref.actor.megatron.{k}=true" for k in ("param_offload", "grad_offload", "optimizer_offload")]
    code, out = finish(train(overrides(addition_model_dir, run, *on_gpus(world), "algorithm.adv_estimator=gae",
                                       "critic.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
                                       "actor_rollout_ref.ref.param_offload=true", *off)))
    assert code == 0, out[-4000:]
    rows = read_metrics(str(run))[1:]
    for key in ("critic/vf_loss", "perf/mfu/critic", "perf/mfu/ref", "perf/mfu/compute_values", "memory/offloaded_gb",
                "memory/update_critic_peak_gb"):
        assert all(key in r for r in rows), key
    assert all(r["memory/offloaded_gb"] > 0 for r in rows)
    report(f"ppo_offload_w{world}", {"last_step": rows[-1]})


@pytest.mark.timeout(1500)
def test_sigkill_then_resume_is_identical(addition_model_dir, tmp_path):
    """As tests/test_trainer_e2e.py on CPU: a run killed during step 5 and resumed from its step-4
    checkpoint logs the same metrics for steps 5-6 as a run never killed (clocks and memory aside)."""
    gpu = on_gpus(1)
    run_a = tmp_path / "a"
    code, out = finish(train(overrides(addition_model_dir, run_a, *gpu)))
    assert code == 0, out[-3000:]
    rows = {r["step"]: r for r in read_metrics(str(run_a))}
    run_b = tmp_path / "b"
    proc = train(overrides(addition_model_dir, run_b, *gpu))
    pointer = run_b / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 600
    while not (pointer.is_file() and pointer.read_text().strip() == "4"):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    kill_tree(proc)
    code, out = finish(train(overrides(addition_model_dir, run_b, *gpu)))
    assert code == 0, out[-3000:]
    assert "at step 4" in out
    resumed = {r["step"]: r for r in read_metrics(str(run_b))}
    diffs = {step: {k: (v, stable(rows[step]).get(k)) for k, v in stable(resumed[step]).items()
                    if stable(rows[step]).get(k) != v} for step in (5, 6)}
    report("resume", {"differing_metrics": diffs})
    assert diffs == {5: {}, 6: {}}, diffs


@pytest.mark.timeout(900)
def test_multi_turn_tool_use(tmp_path):
    """configs/tool_use.yaml (multi-turn GRPO with a calculator tool) for 3 steps on one GPU."""
    import subprocess
    import sys
    model = tmp_path / "model"
    # the bootstrap named beside the path, so that path is the bootstrap's own (it builds the model there)
    cmd = [sys.executable, "-m", "megarl.train", "--config", "configs/tool_use.yaml", "trainer.device=cuda",
           "actor_rollout_ref.model.bootstrap=megarl.examples.tool_use:bootstrap",
           "trainer.n_gpus_per_node=1", "trainer.total_training_steps=3", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path / 'run'}",
           f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={model / 'tokenizer'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("multiturn/tool_errors" in r and "perf/mfu/actor" in r for r in rows), sorted(rows[-1])
