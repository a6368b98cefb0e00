"""Every script in benchmarks/ runs end to end at its --smoke shape and prints its table, with the
peak resident memory of its processes, so a change that breaks one shows here (the weight-sync
benchmark once broke unseen). Each is run as a user runs it: `python benchmarks/<script> --smoke`.

Grouped to keep the cost down: gpu_check --dry-run runs gpu_update_step's and rollout_throughput's
smoke shapes inside it (their tables are checked in its output; toy_model.py builds the latter's
model at its smoke shape); peers join where they import (vLLM in rollout_throughput; trtllm_check.py runs a tiny model
where tensorrt_llm imports and a GPU is visible, else its one-line refusal is checked and the run
skipped with that reason; vs_trl.py runs TRL's GRPOTrainer from TRL's own venv where one imports, else
its one-line refusal is checked and the run skipped with that line).
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py") and f != "__init__.py")
# helpers imported by the benchmarks, not benchmarks themselves
HELPERS = {"peak_memory.py", "trl_peer.py", "weight_sync_delta.py", "async_engine.py", "plan_vs_measured.py",
           "trtllm_check_routes.py", "vllm_gpu_check.py", "cost_model_check.py", "vllm_peer.py"}
# trl_peer: TRL's side, started by vs_trl.py; weight_sync_delta: run as `weight_sync.py --delta`;
# async_engine: run as `async_speedup.py --longtail --engine-only`, at a small shape inside
# gpu_check --dry-run; plan_vs_measured: gpu_check's memory-plan rows (tests/test_gpu_path.py);
# trtllm_check_routes: trtllm_check's R3 comparison (tests/rollout/test_trtllm_check_routes.py)
# vllm_gpu_check: gpu_check's vLLM section (tests/test_gpu_path.py, tests/rollout/test_vllm_cuda_fake.py)
# cost_model_check: gpu_check's cost-model section (tests/test_cost_model_check.py, tests/test_gpu_path.py)
# vllm_peer: rollout_throughput's vLLM engine (tests/rollout/test_vllm_peer.py, tests/rollout/vllm_checks.py)
# no --smoke flag: gpu_check's is --dry-run; trtllm_check needs TensorRT-LLM and a GPU (see its test)
NO_SMOKE_FLAG = {"gpu_check.py", "trtllm_check.py"}
# run at their smoke shapes inside gpu_check --dry-run (toy_model builds rollout_throughput's model)
INSIDE_GPU_CHECK = {"gpu_update_step.py", "rollout_throughput.py", "toy_model.py"}
PEAK = re.compile(r"peak resident (MiB|memory)")


def run(*args, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_every_benchmark_has_a_smoke_shape_covered_here():
    source = open(__file__).read()
    for script in sorted(set(SCRIPTS) - HELPERS):
        text = open(os.path.join(ROOT, "benchmarks", script)).read()
        assert "--smoke" in text or script in NO_SMOKE_FLAG, f"benchmarks/{script} has no --smoke shape"
        assert f"benchmarks/{script}" in source or script in INSIDE_GPU_CHECK, \
            f"benchmarks/{script} is not run by this test"


@pytest.mark.timeout(900)
def test_gpu_check_dry_run_with_update_step_and_rollout(tmp_path):
    out = run("benchmarks/gpu_check.py", "--device", "cpu", "--dry-run", "--out", str(tmp_path / "report"))
    assert "| matmul float32 512^3 |" in out and "FAILED" not in out
    # gpu_update_step --smoke's table and rollout_throughput --smoke's, printed inside gpu_check
    assert re.search(r"update_policy +[\d.]+ s", out) and "weight sync -> native engine:" in out
    assert re.search(r"native +[\d.]+ tokens/s", out) and re.search(r"ratio native / hf +=", out)
    # the stream's schedule on the long-tailed task, generation alone (async_engine.py at a small
    # shape): both of its tables, the engine's counters and the phase split, and the report's line
    for way in ("whole batch", "chunks of 4", "chunks of 4, pausable", "whole-batch calls",
                "next batch in the tail, pausable"):
        assert re.search(rf"  {re.escape(way)} +[\d.]+ s +[\d.]+x", out), way
    assert len(re.findall(r"prompts prefilled \d+, prefill passes \d+, decode steps \d+, graphs captured 0", out)) >= 2
    assert len(re.findall(r"last round, seconds: prefill [\d.]+, decode steps [\d.]+, read-back [\d.]+", out)) == 2
    assert re.search(r"\| stream schedule, generation alone .* [\d.]+ vs [\d.]+ s per batch: [\d.]+x", out)
    assert PEAK.search(out)
    assert "vllm" not in out                                  # --smoke leaves vLLM out (vllm_checks runs its peer)
    assert os.path.isfile(tmp_path / "report" / "gpu_check.md")


@pytest.mark.timeout(900)
def test_distributed_benchmarks_smoke():
    """The two 4-rank benchmarks (one spawn each), update_profile's TP2 cell and the delta weight
    sync (real Adam steps, full vs delta over both transports, one spawn), side by side."""
    sync, step, profile, delta = run_side_by_side(
        ("benchmarks/weight_sync.py", "--smoke"), ("benchmarks/update_step.py", "--smoke"),
        ("benchmarks/update_profile.py", "--smoke"), ("benchmarks/weight_sync.py", "--delta", "--smoke"))
    out = sync
    for layout in ("(1,1) -> 1", "(1,1) -> 2", "(2,2) -> 1", "(2,2) -> 2"):
        assert re.search(re.escape(layout) + r" +[\d.]+ ", out), out
    assert re.search(r"peak resident MiB per rank.*rank 3 \d+", out)
    out = step
    assert re.search(r"ratio megarl / transformers: [\d.]+", out) and re.search(r"rank 3 \d+", out)
    out = profile      # TP2 (one 2-rank spawn)
    for row in ("model forward", "backward", "grad norm", "collectives", "total", "gloo alone"):
        assert re.search(rf"^{row} +[\d.]+ +[\d.]+$", out, re.M), (row, out)   # wall ms, CPU ms
    assert re.search(r"reduce_scatter_tensor \d+x", out) and re.search(r"rank 1 \d+", out)
    out = delta
    assert re.search(r"delta engines bit-identical to full after every step: yes", out), out
    assert re.search(r"\(2,1\) -> 1 +delta +[\d.]+ ", out) and re.search(r"\(1,2\) -> 2 +delta +[\d.]+ ", out), out
    assert "bit-identical read-back: yes" in out and re.search(r"rank 3 \d+", out), out


@pytest.mark.timeout(600)
def test_weight_sync_over_a_shaped_link_between_two_nodes_smoke():
    """weight_sync_link.py --smoke: trainer and engines on two namespace nodes, 1 Gbit/s tbf link."""
    from tests.multinode.nodes import NodeSet
    why = NodeSet.refusal()
    if why:
        pytest.skip(why)
    out = run("benchmarks/weight_sync_link.py", "--smoke")
    assert "== link 1gbit" in out and "delta engines bit-identical to full after every step: yes" in out, out
    assert re.search(r"\(2,1\) -> 1 +delta +[\d.]+ ", out), out


def run_side_by_side(*commands: tuple[str, ...], timeout=600) -> list[str]:
    """`python <script> <args>` for each command, all at once: the smoke runs check that each
    benchmark runs and what it prints, not its speed. Their outputs, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, cmd in enumerate(commands):
            out, err = (open(os.path.join(tmp, f"{i}.{k}"), "w+") for k in ("out", "err"))
            procs.append((cmd, subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=out, stderr=err, text=True,
                                                env={**os.environ, "PYTHONPATH": ROOT}), out, err))
        got = []
        try:
            for cmd, proc, out, err in procs:
                code = proc.wait(timeout=timeout)
                out.seek(0), err.seek(0)
                got.append(out.read())
                assert code == 0, f"{cmd} exited {code}:\n{got[-1][-3000:]}\n{err.read()[-3000:]}"
        finally:                    # a failure leaves none of the others running
            for _, proc, out, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close(), err.close()
        return got


@pytest.mark.timeout(900)
def test_single_process_benchmarks_smoke():
    out = run("benchmarks/update_memory.py", "--smoke")
    assert re.search(r"^layout +log_prob s", out, re.M) and PEAK.search(out)
    out = run("benchmarks/addition_task.py", "--smoke")
    assert "summary {" in out and PEAK.search(out)
    out = run("benchmarks/recompute_memory.py", "--smoke")
    assert all(re.search(rf"^{s}: peak resident MiB \d+", out, re.M)
               for s in ("off", "full_uniform_1", "selective_core_attn"))
    out = run("benchmarks/multiturn_batching.py", "--smoke")
    assert "same tokens in both arms: True" in out and "batched / sequential speed-up" in out and PEAK.search(out)
    out = run("benchmarks/lora_memory.py", "--smoke")      # full fine-tuning vs LoRA on one model and batch
    rows = {m.group(1): [int(x.replace(",", "")) for x in m.group(2, 3)]
            for m in re.finditer(r"^(full|LoRA r=\d+) +([\d,]+) +([\d,]+) ", out, re.M)}
    assert set(rows) == {"full", "LoRA r=8"}, out
    assert rows["full"][0] == rows["full"][1] and 0 < rows["LoRA r=8"][1] < rows["full"][1] / 5, rows


@pytest.mark.timeout(900)
def test_launcher_benchmarks_smoke(tmp_path):
    """The benchmarks that start `python -m megarl.train` / launch/torchrun.sh as users do, side by side."""
    out, speedup = run_side_by_side(("benchmarks/launch_times.py", "--smoke"),
                                    ("benchmarks/async_speedup.py", "--smoke", "--out", str(tmp_path / "async")))
    assert re.search(r"torchrun.sh +SIGKILL .* [1-9]\d*  rank 0 \d+", out), out
    out = speedup
    assert re.search(r"^sync +\d+ +1\.00x", out, re.M) and re.search(r"^one_step +\d+ +[\d.]+x", out, re.M)
    assert re.search(r"peak resident MiB rank 0 \d+, rank 1 \d+", out)
    assert os.path.isfile(tmp_path / "async" / "accuracy_vs_time.png")


@pytest.mark.timeout(900)
def test_routing_replay_smoke(tmp_path):
    """Both R3 rows and both R2 rows, replay exact where it is on, and one GRPO step with R3 through
    `python -m megarl.train` (engine records, trainer replays) into the PNG."""
    out = run("benchmarks/routing_replay.py", "--smoke", "--out", str(tmp_path))
    for row in ("R3 off", "R3 on", "R2 off", "R2 on"):
        assert re.search(rf"^{row} +[\d.]+ ", out, re.M), out
    assert re.search(r"^R3 on +0\.0000 ", out, re.M) and re.search(r"^R2 on +0\.0000 ", out, re.M)
    assert "1 byte per token per MoE layer per slot" in out and PEAK.search(out)
    assert os.path.isfile(tmp_path / "routing_replay.png")


@pytest.mark.timeout(900)
def test_trtllm_check_where_it_imports(tmp_path):
    import torch
    usable = importlib.util.find_spec("tensorrt_llm") is not None and torch.cuda.is_available()
    if usable:
        from megarl.models.tiny import make_tiny_hf
        model = make_tiny_hf(str(tmp_path / "m"), "qwen2", tokenizer=False)
        run("benchmarks/trtllm_check.py", "--model", model, "--out", str(tmp_path / "report"), "--max-tokens", "4")
        assert os.path.isfile(tmp_path / "report" / "trtllm_check.md")
        return
    proc = subprocess.run([sys.executable, "benchmarks/trtllm_check.py", "--model", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, lines)
    pytest.skip(f"benchmarks/trtllm_check.py not run: {lines[0]}")


def _killed_rank(rank, world):
    """Rank 1 is SIGKILLed (as the OOM killer does) holding 400 MiB; rank 0 waits on it."""
    import signal
    import time

    import torch
    held = torch.ones(50 * 2**20 * (rank + 1))                      # 200 MiB on rank 0, 400 on rank 1
    if rank == 1:
        time.sleep(1.0)                                              # long enough to be sampled
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return float(held[0])


@pytest.mark.timeout(300)
def test_a_killed_rank_is_reported_as_killed_with_its_peak():
    from megarl.parallel.local_ranks import run_local
    with pytest.raises(RuntimeError) as err:
        run_local(2, _killed_rank)
    first, second = str(err.value).splitlines()[:2]
    peak = float(re.search(r"rank 1 was killed by SIGKILL \(the kernel's OOM killer.*at a peak of (\d+) MiB", first)[1])
    assert peak > 400, first                                          # the 400 MiB tensor counts
    assert re.match(r"rank 0 was stopped \(SIGTERM\) after rank 1 ended, at a peak of \d+ MiB", second), second


@pytest.mark.timeout(900)
def test_vs_trl_smoke(tmp_path):
    if importlib.util.find_spec("trl") is None:     # an interpreter without TRL: one line, exit 2, nothing run
        proc = subprocess.run([sys.executable, "benchmarks/vs_trl.py", "--smoke", "--trl-python", sys.executable],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == 2 and proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
        assert proc.stdout.startswith("vs_trl: TRL does not import: ModuleNotFoundError"), proc.stdout
    proc = subprocess.run([sys.executable, "benchmarks/vs_trl.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    if proc.returncode == 2:
        line = proc.stdout.strip()
        assert line.startswith("vs_trl: TRL does not import") and "\n" not in line, proc.stdout + proc.stderr
        pytest.skip(line)
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert re.search(r"TRL GRPOTrainer +[\d.]+ s/step", out) and re.search(r"ratio megarl TP1 / TRL = [\d.]+x", out)
    # the equal-work settings TRL actually ran with, and megarl's skipped pass
    assert '"loss_type": "dapo"' in out and '"beta": 0.0' in out and '"epsilon_high": 0.28' in out
    assert "old-log-prob pass skipped" in out and PEAK.search(out)


def test_async_longtail_task_fits_the_model_it_builds(tmp_path):
    """--longtail's overrides: the task's longest prompt fits data.max_prompt_length, and the model
    it bootstraps has positions for the engine's prompt limit (prompt + a partial response) plus a
    response (a 30-digit tail once asked for 146 positions of a 128-position model)."""
    sys.path.insert(0, ROOT)
    from benchmarks.async_speedup import longtail_extra
    from megarl.examples.addition.model import build_tokenizer
    for digits in (12, 30):
        _, extra = longtail_extra(str(tmp_path / str(digits)), digits, 0.04)
        kv = dict(x.split("=", 1) for x in extra)
        positions = int(kv["actor_rollout_ref.model.bootstrap_kwargs.max_position_embeddings"])
        response = int(kv["data.max_response_length"])
        assert int(kv["actor_rollout_ref.rollout.prompt_length"]) + response <= positions
        tok = build_tokenizer()
        with open(kv["data.train_files"]) as f:
            rows = [json.loads(line) for line in f]
        longest = max(len(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False).input_ids) for r in rows)
        answer = max(len(r["reward_model"]["ground_truth"]) for r in rows)
        assert longest <= int(kv["data.max_prompt_length"]) and answer + 1 <= response, (digits, longest, answer)

