"""The GPU path's logic, checked on CPU: batches on the model's device, offload/onload around the
rollout, peak memory per phase, MFU (FLOPs by hand, peaks by GPU name), and the gpu check's report
plumbing. The same worker checks run on CUDA in tests/gpu (tests/helpers/worker_checks.py)."""
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from megarl.models.flops import attention_flops, forward_flops, matmul_params, training_flops
from megarl.models.spec import ModelSpec
from megarl.trainer.metrics.memory import PhaseMemory
from megarl.trainer.metrics.mfu import MFUMeter, PhaseWork, resolve_peak_flops, table_peak_tflops
from megarl.workers.offload import HostStash
from tests.distributed import run_ranks
from tests.helpers.worker_checks import check_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec(**kw):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
           "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **kw}
    return ModelSpec.from_hf_config(cfg)


def test_flops_by_hand():
    s = _spec()                       # h 64, 8 heads of 8, 2 KV heads, ffn 160, 3 layers, vocab 1000
    # per layer: q 64x64, k and v 64x16 each, o 64x64, mlp 3 x 64x160; head 64x1000
    per_layer = 64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 160
    assert matmul_params(s) == 3 * per_layer + 64 * 1000
    assert matmul_params(s, head="value") == 3 * per_layer + 64
    # causal attention of a 5-token sequence: 15 (q, k) pairs, QK^T and AV, 2 FLOPs each, 64 wide, 3 layers
    assert attention_flops(s, 5) == 3 * 2 * 2 * 64 * 15
    lens = [5, 2]                     # real lengths, not the padded width
    fwd = 2 * matmul_params(s) * 7 + 3 * 4 * 64 * (15 + 3)
    assert forward_flops(s, lens) == fwd
    assert training_flops(s, lens) == 3 * fwd and training_flops(s, lens, recompute=True) == 4 * fwd


def test_peak_by_gpu_name_and_key():
    assert table_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert table_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert table_peak_tflops("NVIDIA H200") == 989.0
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert table_peak_tflops("NVIDIA L40S") == 362.0
    assert table_peak_tflops("Some Future Accelerator") is None
    assert resolve_peak_flops(None, torch.device("cpu"))[0] is None          # no MFU on CPU by default
    assert resolve_peak_flops(2.5, torch.device("cpu"))[0] == 2.5e12


def test_mfu_metrics_from_timings():
    from megarl.protocol import DataProto
    s = _spec()
    batch = DataProto.from_dict({"prompt_lens": torch.tensor([3, 2]), "response_lens": torch.tensor([2, 0])})
    work = {"update_actor": PhaseWork("actor", s, "lm", True, repeats=2),
            "old_log_prob": PhaseWork("compute_log_prob", s, "lm", False)}
    meter = MFUMeter(work, world=2, peak_flops=1e9)
    got = meter.metrics(batch, {"update_actor": 0.5, "old_log_prob": 0.25, "gen": 1.0})
    fwd = forward_flops(s, [5, 2])
    assert set(got) == {"perf/mfu/actor", "perf/mfu/compute_log_prob"}
    assert math.isclose(got["perf/mfu/actor"], 2 * 3 * fwd / (0.5 * 2 * 1e9))
    assert math.isclose(got["perf/mfu/compute_log_prob"], fwd / (0.25 * 2 * 1e9))
    assert MFUMeter(work, 2, None).metrics(batch, {"update_actor": 0.5}) == {}


def test_peak_tflops_key_is_validated():
    from megarl.config import ConfigError
    from megarl.trainer.config import TrainerConfig
    assert TrainerConfig(peak_tflops=989).peak_tflops == 989
    with pytest.raises(ConfigError, match="peak_tflops"):
        TrainerConfig(peak_tflops=0)


def test_host_stash_frees_storage_and_restores_bit_exact():
    w = torch.randn(64, 32)
    view = w[3:7]                     # a view (as DDP's main_grad views into its flat buffer)
    g = torch.randn(100)
    want_w, want_view = w.clone(), view.clone()
    stash = HostStash()
    done = stash.offload([w, view], keep=True)
    stash.offload([g, w], keep=False, skip=done)   # w is held already: not freed twice, not zeroed
    assert w.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert g.untyped_storage().nbytes() == 0 and stash.nbytes == (64 * 32 + 100) * 4
    stash.onload()
    assert torch.equal(w, want_w) and torch.equal(view, want_view)
    assert torch.equal(g, torch.zeros(100))        # keep=False: freed without a copy, back as zeros
    assert not stash


def test_phase_memory_nested_on_cpu():
    meter = PhaseMemory(torch.device("cpu"))
    if not meter.enabled:
        pytest.skip("no /proc/self/status here")
    keep = []
    with meter.phase("step"):
        with meter.phase("small"):
            pass
        with meter.phase("big"):
            keep.append(torch.ones(48 * 2**20 // 4))   # 48 MiB, touched
        with meter.phase(None):                        # a disabled phase is not reported
            pass
    got = meter.metrics()
    assert set(got) == {"memory/step_rss_growth_gb", "memory/small_rss_growth_gb", "memory/big_rss_growth_gb"}
    assert got["memory/big_rss_growth_gb"] >= 40 / 1024
    assert got["memory/step_rss_growth_gb"] >= got["memory/big_rss_growth_gb"] - 1 / 1024
    assert got["memory/small_rss_growth_gb"] < got["memory/big_rss_growth_gb"]
    assert meter.metrics() == {}


def test_trainer_handoff_moves_every_trainable_role():
    from types import SimpleNamespace

    from megarl.trainer.loop.fit import RLTrainer

    class Role:
        def __init__(self, n):
            self.n, self.calls = n, []

        def offload(self):
            self.calls.append("off")
            return self.n

        def onload(self):
            self.calls.append("on")

    actor, critic = Role(2**30), Role(2**29)
    fake = SimpleNamespace(p=SimpleNamespace(trainable_roles=lambda: {"actor": actor, "critic": critic}), extra={})
    RLTrainer.handoff(fake, "engine")
    RLTrainer.handoff(fake, "trainer")
    assert actor.calls == critic.calls == ["off", "on"]
    assert fake.extra == {"memory/offloaded_gb": 1.5}


@pytest.mark.timeout(300)
def test_device_placement_offload_cycle_and_weight_sync_on_gloo(tmp_path):
    from megarl.models.tiny import make_tiny_hf
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", seed=5, tokenizer=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_ranks(2, check_all, (path, "cpu"))
    off = [g["offload"] for g in got]
    assert off[0]["moved_bytes"] > 0 and off[0]["metrics"] == off[1]["metrics"]
    assert got[0]["sync"]["sync"]["weight_sync/seconds"] > 0


def test_gpu_check_report_plumbing_on_cpu(tmp_path):
    """`--device cpu --dry-run` goes through every section of the report quickly and writes both files."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--dry-run",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    for key in ("device", "versions", "sections"):
        assert key in report
    assert {"torch", "megatron-core", "transformers"} <= set(report["versions"])
    sections = {s["name"]: s for s in report["sections"]}
    assert set(sections) == {"matmul", "update_step_micro2", "rollout", "stream", "vllm", "cost_model", "mfu",
                             "offload"}
    assert all(s["ok"] for s in sections.values()), [s.get("traceback") for s in sections.values()]
    upd = sections["update_step_micro2"]["result"]
    assert upd["update_policy_mfu"] > 0 and upd["weight_sync"]["gb_per_s"] > 0
    assert upd["offload"]["resident_gb_after"] == 0 < upd["offload"]["resident_gb_before"]
    md = (out / "gpu_check.md").read_text()
    assert "| update_policy MFU (micro 2, tiny) |" in md and "| rollout tokens/s |" in md
    # --check's memory plan against the measured bytes: the static part exact on CPU too
    assert [(r["phase"], r["ok"]) for r in upd["memory_plan"]] == [("static", True)]
    assert "| memory plan vs measured (micro 2) | static: planned " in md
    assert sections["stream"]["result"]["speedup"] > 0 and "| stream schedule, generation alone" in md
    # the dry run never starts vLLM: its section says why, in the report's one line
    assert sections["vllm"]["result"] == {"skipped": "device cpu: the section needs vLLM's CUDA build on a GPU"}
    assert "| vLLM (CUDA build) | skipped: device cpu:" in md
    # the cost model's terms on the device, labelled as plumbing on CPU (tests/test_cost_model_check.py)
    assert "| cost model vs this device (dry run on CPU: plumbing only, these are not GPU figures) |" in md


def test_gpu_check_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 2
    lines = [line for line in proc.stdout.strip().splitlines() + proc.stderr.strip().splitlines()
             if line.startswith("gpu_check")]
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stdout + proc.stderr


def test_distributed_optimizer_default_follows_the_device():
    from megarl.workers.actor import _distributed_optimizer
    from megarl.workers.config import MegatronConfig
    # null: megatron's distributed optimizer wherever megatron's optimizer runs (CUDA); CPU runs CPUAdamW
    assert _distributed_optimizer(MegatronConfig()) is torch.cuda.is_available()
    assert _distributed_optimizer(MegatronConfig(use_distributed_optimizer=False)) is False
    assert _distributed_optimizer(MegatronConfig(use_distributed_optimizer=True)) is True


def test_a_fresh_torch_adam_is_primed_for_a_checkpoint_load_without_changing_what_it_trains():
    """A resume on CUDA without Transformer Engine: megatron's distributed optimizer reads every
    parameter's `step` before loading, so the fresh torch Adam inside it is primed first. The primed
    state must be exactly what a loaded checkpoint then overwrites: training resumed from it equals
    training never stopped, bit for bit."""
    import copy
    from types import SimpleNamespace

    from megarl.workers.optim import prime_for_load

    def adam(params):
        return torch.optim.Adam([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}], lr=1e-2,
                                decoupled_weight_decay=True)

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a = adam(a)

    def step(params, opt, k):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (k + 1) * (i + 1))
        opt.step()

    for k in range(3):
        step(a, opt_a, k)
    saved = copy.deepcopy(opt_a.state_dict())     # torch's state_dict shares the live tensors
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa)
    opt_b = adam(b)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=opt_b)])
    prime_for_load(chained)
    assert all(set(opt_b.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in b)
    assert {float(opt_b.state[p]["step"]) for p in b} == {0.0}          # one step value, as megatron asserts
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))              # priming moves no weight
    opt_b.load_state_dict(saved)
    for k in range(3, 5):
        step(a, opt_a, k)
        step(b, opt_b, k)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))
    prime_for_load(chained)                                             # a stepped optimizer is left alone
    assert float(opt_b.state[b[0]]["step"]) == 5.0



def _distributed_optimizer_on_cpu(model_params: list[torch.Tensor], init: float | None = None):
    """megatron-core's DistributedOptimizer load code (its own methods, unchanged) over the
    attributes they read, at DP 1 with one buffer: its constructor needs CUDA, its loading does not.
    Main params are the flat fp32 copies megatron keeps; `init` fills them (a fresh run's values)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    class Part:
        state_dict = DistributedOptimizer.state_dict
        load_state_dict = DistributedOptimizer.load_state_dict
        load_parameter_state_from_fully_reshardable = DistributedOptimizer.load_parameter_state_from_fully_reshardable
        _set_main_param_and_optimizer_states = DistributedOptimizer._set_main_param_and_optimizer_states

    part = Part()
    mains = [torch.nn.Parameter(p.detach().float().flatten().clone() if init is None
                                else torch.full((p.numel(),), init)) for p in model_params]
    ident = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    part.optimizer = torch.optim.Adam([{"params": mains[:1], "wd_mult": 1.0, "weight_decay": 0.1, **ident},
                                       {"params": mains[1:], "wd_mult": 0.0, "weight_decay": 0.0, **ident}],
                                      lr=1e-2, decoupled_weight_decay=True)
    part.ddp_config = type("DDPConfig", (), {"use_megatron_fsdp": False})()
    part.config = type("OptimizerConfig", (), {"fp16": False,
                                               "use_precision_aware_optimizer_no_fp8_or_ds_fp8": False})()
    part.grad_scaler = None
    part.model_param_group_index_map = {p: (min(i, 1), max(i - 1, 0)) for i, p in enumerate(model_params)}
    index, start = {}, 0
    for p in model_params:
        index[p] = (start, start + p.numel(), 0)
        start += p.numel()
    part.buffers = [type("Buffer", (), {"param_index_map": index})()]
    part.gbuf_ranges = [{torch.float32: [{"param_map": {p: {"param": Range(0, p.numel())} for p in model_params}}]}]
    return part, mains


def test_a_distributed_optimizer_resume_loads_torch_adam_state_exactly():
    """On CUDA without Transformer Engine or Apex, megatron-core 0.16's DistributedOptimizer cannot
    load its own fully_reshardable checkpoint into torch's Adam (KeyError 'step': an H100 run's
    resume failed so). megarl's load_optimizer loads it: main params, both moments and the step
    are the saved ones, and training on from there equals training never stopped, bit for bit."""
    import copy

    from megarl.workers.optim import load_optimizer, prime_for_load

    torch.manual_seed(0)
    model = [torch.randn(4, 3), torch.randn(5)]
    ref, ref_mains = _distributed_optimizer_on_cpu(model)

    def step(mains, opt, k):
        for i, p in enumerate(mains):
            p.grad = torch.linspace(-1, 1, p.numel()) * 0.1 * (k + 1) * (i + 1)
        opt.step()

    for k in range(3):
        step(ref_mains, ref.optimizer, k)
    saved = copy.deepcopy({**ref.state_dict(), "param_state_sharding_type": "fully_reshardable",
                           "param_state": {i: {"param": m.detach().view(p.shape),
                                               "exp_avg": ref.optimizer.state[m]["exp_avg"].view(p.shape),
                                               "exp_avg_sq": ref.optimizer.state[m]["exp_avg_sq"].view(p.shape)}
                                           for i, (m, p) in enumerate(zip(ref_mains, model))}})
    assert all("step" in g for g in saved["optimizer"]["param_groups"])

    plain, _ = _distributed_optimizer_on_cpu(model, init=0.0)      # megatron's own load, primed as megarl primes
    prime_for_load(plain)
    with pytest.raises(KeyError, match="step"):
        plain.load_state_dict(copy.deepcopy(saved))

    fresh, mains = _distributed_optimizer_on_cpu(model, init=0.0)
    prime_for_load(fresh)
    load_optimizer(fresh, copy.deepcopy(saved))
    for m, r in zip(mains, ref_mains):
        assert torch.equal(m, r)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.optimizer.state[m][key], ref.optimizer.state[r][key]), key
    for k in range(3, 5):
        step(ref_mains, ref.optimizer, k)
        step(mains, fresh.optimizer, k)
    assert all(torch.equal(m, r) for m, r in zip(mains, ref_mains))


def test_gpu_check_reports_each_test_even_when_its_time_box_ends(tmp_path):
    """gpu_check's tests section keeps every finished test's outcome (pytest -v), also when
    --tests-timeout stops tests/gpu: a GPU lent for minutes still says what passed. On CPU every
    test in tests/gpu skips, each one named."""
    sys.path.insert(0, ROOT)
    from benchmarks.gpu_check import run_tests

    done = run_tests(str(tmp_path / "full"))
    assert done["returncode"] == 0 and done["outcomes"], done
    assert set(done["outcomes"].values()) == {"SKIPPED"}
    assert "tests/gpu/test_gpu.py::test_sigkill_then_resume_is_identical" in done["outcomes"]
    stopped = run_tests(str(tmp_path / "boxed"), timeout_s=0.01)
    assert stopped["returncode"] == "timeout" and stopped["summary"].startswith("stopped after 0.01 s: "), stopped
