"""The TensorRT-LLM engine on CPU, against conformance fakes built from TensorRT-LLM's signatures.

FAKES: tensorrt_llm cannot be installed here (no CUDA; its wheel comes from NVIDIA's index). Each
snapshot in tests/assets/trtllm (SamplingParams / LLM args / KvCacheConfig / SleepConfig fields,
output fields, log-prob format, with its source commit and provenance) becomes a fake package
(tests/rollout/trtllm_fake.py) that rejects anything outside the snapshot and generates real
tokens with a transformers model. These tests show megarl's side of the API against those
signatures; they do not show TensorRT-LLM itself behaves so. The real package runs the same
conformance suite through tests/rollout/test_conformance.py wherever it imports.
"""
from __future__ import annotations

import base64
import os
import pickle
import sys
import textwrap

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.trtllm import (TRTLLMEngine, bucket_handles, checkpoint_names, completion_from_output,
                                   detect_features, llm_kwargs, placement)
from megarl.rollout.trtllm.args import logprob_mode, prompt_seed, response_budget, sampling_kwargs
from tests.assets.trtllm import extract_snapshot
from tests.rollout import conformance, trtllm_fake
from tests.rollout.fixtures import save_model, state_of

V12, V13, V29 = "trtllm-1.2.0rc2.json", "trtllm-1.3.0rc21.json", "trtllm-1.3.0rc29.json"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine_cfg(**kw) -> RolloutConfig:
    base = dict(name="trtllm", load_format="auto", prompt_length=16, response_length=12)
    return RolloutConfig(**{**base, **kw})


# -- snapshots and the fake ---------------------------------------------------------------------------
def test_extractor_reads_the_fields_from_source(tmp_path):
    files = {
        "tensorrt_llm/version.py": '__version__ = "9.9.0"\n',
        "tensorrt_llm/sampling_params.py": """
            from dataclasses import dataclass, field
            @dataclass(slots=True, kw_only=True)
            class SamplingParams:
                n: int = 1
                _bad_word_ids: list = field(default=None, init=False, repr=False)
                logprobs_mode: str = None
                _return_log_probs: bool = False
            class LogprobMode(str):
                RAW = "raw"
                PROCESSED = "processed"
            """,
        "tensorrt_llm/llmapi/llm_args.py": """
            class StrictBaseModel: pass
            class BaseLlmArgs(StrictBaseModel):
                model: str
                _private: int = PrivateAttr(0)
            class TorchLlmArgs(BaseLlmArgs):
                sleep_config: object = None
            class KvCacheConfig(StrictBaseModel):
                free_gpu_memory_fraction: float = 0.9
            class SleepConfig(StrictBaseModel):
                restore_modes: dict = None
            class ExecutorMemoryType(str):
                KV_CACHE = "kv_cache"
                MODEL = "model"
            """,
        "tensorrt_llm/executor/result.py": """
            class Logprob:
                logprob: float
                rank: int = None
            class CompletionOutput:
                index: int
                token_ids: list = None
                _last_text_len: int = field(default=0, init=False)
            """,
    }
    for rel, text in files.items():
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    snap = extract_snapshot.snapshot(extract_snapshot.reader(str(tmp_path), None), "abc123")
    assert snap["version"] == "9.9.0" and snap["commit"] == "abc123"
    assert snap["sampling_params_fields"] == ["n", "logprobs_mode", "_return_log_probs"], "init=False is no argument"
    assert snap["llm_args_fields"] == ["model", "sleep_config"], "base fields in, private attributes out"
    assert snap["kv_cache_config_fields"] == ["free_gpu_memory_fraction"]
    assert snap["sleep_config_fields"] == ["restore_modes"] and snap["executor_memory_types"] == ["kv_cache", "model"]
    assert snap["completion_output_fields"] == ["index", "token_ids"] and snap["logprob_fields"] == ["logprob", "rank"]
    assert snap["logprobs_modes"] == ["raw", "processed"] and snap["logprobs_format"] == "sampled_plus_topk_dict"
    assert snap["fields"]["executor_memory_types"] == {"repo": "NVIDIA/TensorRT-LLM", "commit": "abc123",
                                                       "path": "tensorrt_llm/llmapi/llm_args.py"}
    # Newer layout: llm_args.py imports the enum from _torch/virtual_memory.py; the extractor follows it.
    args = (tmp_path / "tensorrt_llm/llmapi/llm_args.py").read_text()
    start = args.index("class ExecutorMemoryType")
    (tmp_path / "tensorrt_llm/llmapi/llm_args.py").write_text(
        "from ..._torch.virtual_memory import ExecutorMemoryType\n" + args[:start])
    os.makedirs(tmp_path / "tensorrt_llm/_torch", exist_ok=True)
    (tmp_path / "tensorrt_llm/_torch/virtual_memory.py").write_text(
        "class ExecutorMemoryType(StrEnum):\n    MODEL_WEIGHTS_MAIN = 'model_weights'\n    KV_CACHE = 'kv_cache'\n")
    snap = extract_snapshot.snapshot(extract_snapshot.reader(str(tmp_path), None), "def456")
    assert snap["executor_memory_types"] == ["model_weights", "kv_cache"]
    assert snap["fields"]["executor_memory_types"]["path"] == "tensorrt_llm/_torch/virtual_memory.py"
    assert snap["fields"]["sampling_params_fields"]["path"] == "tensorrt_llm/sampling_params.py"


@pytest.mark.parametrize("name", trtllm_fake.SNAPSHOTS)
def test_snapshot_records_its_source(name):
    snap = trtllm_fake.load_snapshot(name)
    assert snap["version"] in name and snap["stand_in"], "each snapshot says which commits stand in for its tag"
    for key in ("sampling_params_fields", "llm_args_fields", "kv_cache_config_fields", "completion_output_fields",
                "sampling_rules", "executor_memory_types"):
        src = snap["fields"][key]
        assert src["repo"] == "NVIDIA/TensorRT-LLM" and src["path"].startswith(("tensorrt_llm/", "tests/")), key
        assert src["commit"] is None or len(src["commit"]) >= 7, key
        assert src["commit"] or "commit" in src["note"], f"{key}: a field without a commit says why"
        if key != "executor_memory_types":
            assert snap[key], key


def test_the_fakes_are_as_strict_as_the_snapshots(monkeypatch, dirs):
    t12 = trtllm_fake.install(monkeypatch, V12)
    with pytest.raises(TypeError, match="logprobs_mode"):
        t12.SamplingParams(logprobs=1, logprobs_mode="processed")      # PR #9675 is 1.3
    with pytest.raises(ValueError, match="Greedy decoding"):
        t12.SamplingParams(n=2, temperature=0.0)
    with pytest.raises(ValueError, match="sleep_config"):
        t12.LLM(model=dirs["a"], sleep_config=None)
    with pytest.raises(ValueError, match="Extra inputs"):
        t12.llmapi.KvCacheConfig(free_gpu_memory_fraction=0.5, gpu_memory_utilization=0.5)
    # 1.2's top-K dicts: somewhere the sampled token is missing from them.
    llm = t12.LLM(model=dirs["a"])
    out = llm.generate([[3, 17, 42]], t12.SamplingParams(max_tokens=12, temperature=1.3, logprobs=1, seed=2))
    comp = out[0].outputs[0]
    assert any(tok not in entry for tok, entry in zip(comp.token_ids, comp.logprobs)), "pick a seed that shows it"
    with pytest.raises(RuntimeError, match="lack the sampled token"):
        completion_from_output(comp)
    t13 = trtllm_fake.install(monkeypatch, V13)
    with pytest.raises(ValueError, match="enable_sleep"):
        t13.LLM(model=dirs["a"], enable_sleep=True)                    # replaced by sleep_config
    with pytest.raises(ValueError, match="logprobs_mode must be"):
        t13.SamplingParams(logprobs=1, logprobs_mode="logits")


def test_feature_detection_reads_the_classes(monkeypatch):
    f12 = detect_features(trtllm_fake.install(monkeypatch, V12))
    assert not f12.logprobs_mode and not f12.simple_format and f12.sleep == "enable_sleep"
    f13 = detect_features(trtllm_fake.install(monkeypatch, V13))
    assert f13.logprobs_mode and f13.simple_format and f13.sleep == "sleep_config"
    assert "logprobs_mode=True" in f13.summary() and f13.version == "1.3.0rc21"


def test_1_2_is_refused_for_rollouts_in_one_line(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V12)
    with pytest.raises(ConfigError, match=r"TensorRT-LLM >= 1\.3 \(SamplingParams\.logprobs_mode") as err:
        TRTLLMEngine(dirs["a"], engine_cfg(), device="cpu")
    assert "\n" not in str(err.value)


# -- arguments --------------------------------------------------------------------------------------------
def test_llm_kwargs_fit_the_snapshot_and_sleep_keeps_or_drops_weights(monkeypatch, dirs):
    tllm = trtllm_fake.install(monkeypatch, V13)
    feats, args = detect_features(tllm), tllm.llmapi.llm_args
    cfg = engine_cfg(tensor_model_parallel_size=2, max_num_seqs=64, gpu_memory_utilization=0.6,
                     enable_prefix_caching=False, engine_kwargs={"trtllm": {"max_num_tokens": 4096,
                                                                              "allreduce_strategy": None}})
    kw = llm_kwargs(cfg, dirs["a"], feats, args, extension=placement.EXTENSION)
    assert kw["tensor_parallel_size"] == 2 and kw["max_seq_len"] == 28 and kw["max_input_len"] == 16
    assert kw["kv_cache_config"] == args.KvCacheConfig(free_gpu_memory_fraction=0.6, enable_block_reuse=False)
    assert kw["max_num_tokens"] == 4096 and "allreduce_strategy" not in kw, "engine_kwargs wins; null removes"
    assert kw["ray_worker_extension_cls"] == placement.EXTENSION and "enable_sleep" not in kw
    keep = {m.value: v for m, v in kw["sleep_config"].restore_modes.items()}
    assert keep == {"kv_cache": "NONE"}, "load_format=auto: the weights are not named, so they keep their content"
    drop = llm_kwargs(engine_cfg(load_format="dummy"), dirs["a"], feats, args)["sleep_config"].restore_modes
    assert {m.value: v for m, v in drop.items()} == {"kv_cache": "NONE", "model_weights": "NONE"}, \
        "only the weights and the KV cache are discarded; every other tag keeps its content"
    tllm.LLM(**llm_kwargs(engine_cfg(), dirs["a"], feats, args))   # the strict fake accepts every key
    with pytest.raises(ConfigError, match=r"no argument\(s\) \['gpu_memory_utilisation'\]"):
        llm_kwargs(engine_cfg(engine_kwargs={"trtllm": {"gpu_memory_utilisation": 0.5}}), dirs["a"], feats, args)


@pytest.mark.parametrize("sp, mode", [
    (SamplingParams(do_sample=False, temperature=0.7, top_k=5), "raw"),      # greedy: T=1 by convention
    (SamplingParams(temperature=1.0, top_p=0.9, top_k=20), "raw"),           # T=1: raw == ours
    (SamplingParams(temperature=0.7), "processed"),                          # only temperature applies
    (SamplingParams(temperature=0.7, top_p=0.9), None),                      # processed would renormalise
    (SamplingParams(temperature=0.7, repetition_penalty=1.2), None),
])
def test_logprob_mode_matches_the_trainer_or_refuses(sp, mode):
    if mode is None:
        with pytest.raises(ConfigError, match="set temperature=1.0, or drop top_k/top_p"):
            logprob_mode(sp)
    else:
        assert logprob_mode(sp) == mode


def test_sampling_kwargs_budget_and_greedy_n(monkeypatch):
    feats = detect_features(trtllm_fake.install(monkeypatch, V13))
    sp = SamplingParams(n=4, max_tokens=32, temperature=0.7, seed=5, stop_token_ids=[9], eos_token_ids=[2])
    kw = sampling_kwargs(sp, feats, max_tokens=20, pad_token_id=0)
    assert kw["n"] == 4 and kw["max_tokens"] == 20 and kw["temperature"] == 0.7 and kw["seed"] == prompt_seed(5, 0)
    assert kw["stop_token_ids"] == [2, 9] and kw["end_id"] == 2 and kw["pad_id"] == 0 and \
        kw["include_stop_str_in_output"]
    assert kw["logprobs"] == 0 and kw["logprobs_mode"] == "processed" and kw["logprobs_simple_format"]
    tllm = sys.modules["tensorrt_llm"]
    assert tllm.SamplingParams(**kw).logprobs == 0, "the strict fake accepts the pair (0 = the sampled token only)"
    assert "return_generation_logits" not in kw, "never a full-vocabulary transfer"
    kw = sampling_kwargs(SamplingParams(n=3, do_sample=False, top_k=5), feats, max_tokens=4)
    assert kw["n"] == 1 and kw["temperature"] == 0.0 and kw["top_k"] == 0, "greedy asks one, the engine copies"
    assert response_budget(SamplingParams(max_tokens=12), 20, 28) == 8
    assert response_budget(SamplingParams(max_tokens=12), 3, 28) == 12
    with pytest.raises(ValueError, match="no room in max_model_len=28"):
        response_budget(SamplingParams(max_tokens=12), 28, 28)


def test_config_refusals(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V13)
    with pytest.raises(ConfigError, match="free_cache_engine=true needs enable_sleep_mode=true"):
        TRTLLMEngine(dirs["a"], engine_cfg(enable_sleep_mode=False), device="cpu")
    with pytest.raises(ConfigError, match="temperature=0.6 together with top_k=-1/top_p=0.9"):
        TRTLLMEngine(dirs["a"], engine_cfg(temperature=0.6, top_p=0.9), device="cpu")
    engine = TRTLLMEngine(dirs["a"], engine_cfg(enable_sleep_mode=False, free_cache_engine=False), device="cpu")
    with pytest.raises(RuntimeError, match="enable_sleep_mode=false: it cannot sleep"):
        engine.sleep()


# -- placement ------------------------------------------------------------------------------------------------
def test_placement_checks():
    members = [("h", "GPU-a", "2"), ("h", "GPU-b", "3")]
    assert placement.group_devices(members, 2) == (["GPU-a", "GPU-b"], [2, 3])
    with pytest.raises(RuntimeError, match="spans hosts"):
        placement.group_devices([("h1", "GPU-a", "0"), ("h2", "GPU-b", "1")], 2)
    with pytest.raises(RuntimeError, match="share a GPU"):
        placement.group_devices([("h", "GPU-a", "0"), ("h", "GPU-a", "0")], 2)
    with pytest.raises(RuntimeError, match="got 1 rank"):
        placement.group_devices([("h", "GPU-a", "0")], 2)
    with pytest.raises(RuntimeError, match="parse integer ids .* set CUDA_VISIBLE_DEVICES to integer ordinals"):
        placement.group_devices([("h", "GPU-a", "GPU-a"), ("h", "GPU-b", "1")], 2)
    assert placement.device_ordinal(1, None) == "1" and placement.device_ordinal(1, "4, 5,6") == "5"
    assert placement.device_ordinal(0, "GPU-x") == "GPU-x", "refused by group_devices on every rank alike"
    placement.check_worker_devices(["GPU-b", "GPU-a"], ["GPU-a", "GPU-b"])
    with pytest.raises(RuntimeError, match=r"run on GPUs \['GPU-a', 'GPU-c'\] \(worker 1 on GPU-c\) but .* hold"):
        placement.check_worker_devices(["GPU-a", "GPU-c"], ["GPU-a", "GPU-b"])
    with pytest.raises(RuntimeError, match="not one each"):
        placement.check_worker_devices(["GPU-a", "GPU-a"], ["GPU-a", "GPU-b"])
    env = placement.worker_environment([2, 3], {"PYTHONPATH": "/x", "TLLM_RAY_FORCE_LOCAL_CLUSTER": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["TLLM_RAY_FORCE_LOCAL_CLUSTER"] == "0", \
        "an explicit one is kept"
    assert env["PYTHONPATH"].split(os.pathsep) == [placement.megarl_root(), "/x"]
    assert placement.worker_environment([0], {})["TLLM_RAY_FORCE_LOCAL_CLUSTER"] == "1"
    before = {k: os.environ.get(k) for k in env}
    with placement.worker_env([6, 7]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert {k: os.environ.get(k) for k in env} == before
    line = placement.start_failure(RuntimeError("RayGPUWorker died during initialization"))
    assert "pip install -e" in line and "\n" not in line
    assert placement.start_failure(ValueError("CUDA out of memory")) is None


def test_workers_land_on_the_groups_gpu_or_start_up_stops(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V13)
    engine = TRTLLMEngine(dirs["a"], engine_cfg(), device="cpu:3")      # this rank holds GPU-fake-3
    assert engine.llm.workers == ["GPU-fake-3"] and engine.group_uuids == ["GPU-fake-3"]
    engine.close()
    assert engine.llm is None
    # Placed in another GPU's bundle the worker lands on GPU 0: the UUID check stops start-up.
    # (The workers still get megarl on their PYTHONPATH, so only the device check can stop them.)
    from megarl.rollout.trtllm import node_ray
    monkeypatch.setenv("PYTHONPATH", placement.megarl_root())
    monkeypatch.setattr(node_ray, "bundle_plan", lambda gpus, ordinals, share=1.0: [0])
    with pytest.raises(RuntimeError, match="TP workers run on GPUs \\['GPU-fake-0'\\] \\(worker 0 on GPU-fake-0\\)"):
        TRTLLMEngine(dirs["a"], engine_cfg(), device="cpu:3")
    assert trtllm_fake.sys.modules["tensorrt_llm"].LLM.instances[-1].shut, "a failed start shuts the LLM down"


# -- sleep, refit, memory ---------------------------------------------------------------------------------------
def _sync(engine, named):
    for bucket in (named[:6], named[6:]):
        engine.update_weights(bucket)
    engine.finalize_weights()


def test_sleep_drops_weights_and_the_kv_cache_wakes_after_the_refit(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V13)
    named = state_of(dirs["model_a"])
    engine = TRTLLMEngine(dirs["a"], engine_cfg(load_format="dummy"), device="cpu")
    llm = engine.llm
    _sync(engine, named)
    greedy = SamplingParams(n=2, max_tokens=6, do_sample=False)
    ref = engine.generate([[3, 17, 42]], greedy)
    assert ref[0][0].token_ids == ref[0][1].token_ids, "greedy n=2 works: one request, copied"
    engine.sleep()
    assert llm.released == {"kv_cache", "model_weights", *llm.extra_tags}, "every tag leaves the GPU"
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[3, 17, 42]], greedy)
    mark = len(llm.events)
    _sync(engine, named)                          # the trainer's sync while asleep
    during = llm.events[mark:]
    awake = llm.weight_bytes + trtllm_fake.KV_BYTES + trtllm_fake.EXTRA_BYTES * len(llm.extra_tags)
    assert not any(e[0] == "resume kv_cache" for e in during)
    assert max(b for _, b in during) < awake, "KV never resident during the refit"
    assert llm.released == {"kv_cache"}
    engine.wake()
    assert not llm.released and llm.events[-1][0] == "resume kv_cache"
    copied = {e[0].removeprefix("host copy ") for e in llm.events if e[0].startswith("host copy")}
    assert copied == set(llm.extra_tags), "a host round trip for the small tags, never the weights or KV"
    assert engine.generate([[3, 17, 42]], greedy)[0][0].token_ids == ref[0][0].token_ids
    engine.sleep()
    engine.wake()                                  # woken without a sync: dropped weights are refused
    with pytest.raises(RuntimeError, match="sync weights before generating"):
        engine.generate([[3, 17, 42]], greedy)


def test_sleep_backs_the_weights_up_when_they_do_not_come_from_syncs(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V13)
    engine = TRTLLMEngine(dirs["a"], engine_cfg(load_format="auto"), device="cpu")
    ref = engine.generate([[5, 6]], SamplingParams(max_tokens=5, do_sample=False))
    engine.sleep()
    assert engine.llm.released == {"kv_cache", "model_weights", *engine.llm.extra_tags}
    assert ("host copy model_weights", engine.llm.weight_bytes) in engine.llm.events, "kept through a host copy"
    engine.wake()
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=5, do_sample=False)) == ref


def test_bucket_handles_carry_names_and_rebuild(tmp_path):
    named = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(2, 3))]
    handles = bucket_handles(named, "GPU-fake-uuid")
    decoded = pickle.loads(base64.b64decode(handles["GPU-fake-uuid"]))
    assert [n for n, _ in decoded] == ["model.norm.weight", "lm_head.weight"]
    for (name, (rebuild, args)), (_, original) in zip(decoded, named):
        assert torch.equal(rebuild(*args), original)      # CPU handles rebuild in-process
    model = save_model(str(tmp_path), seed=0)
    assert set(checkpoint_names(str(tmp_path))) == {n for n, _ in state_of(model)}


# -- the conformance suite against the fake -------------------------------------------------------------------------
@pytest.mark.parametrize("snapshot", trtllm_fake.SNAPSHOTS)
@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_conformance_on_each_snapshot(monkeypatch, dirs, snapshot, check, record_property):
    """1.3+: every check passes (seeds repeat only from PR #17172 on). A version without logprobs_mode:
    every check is refused at start-up."""
    snap = trtllm_fake.load_snapshot(snapshot)
    trtllm_fake.install(monkeypatch, snapshot)

    made = []

    def make(**overrides):
        for old in made:                     # its workers hold the GPU's bundle until closed
            old.close()
        made.append(TRTLLMEngine(dirs["a"], engine_cfg(**{"prompt_length": None, "response_length": None,
                                                          **overrides}), device="cpu"))
        return made[-1]
    if snap["logprobs_modes"] is None:
        with pytest.raises(ConfigError, match="rollouts need TensorRT-LLM >= 1.3"):
            check(make, dirs)
        return
    if check is conformance.check_seed_determinism and snap["seed_semantics"] == "ignored":
        # Before PR #17172 TorchSampler ignores the seed: no adapter can make a call repeat.
        with pytest.raises(AssertionError, match="the same seed must give the same tokens"):
            check(make, dirs)
        return
    for key, value in check(make, dirs).items():
        record_property(key, value)
        assert value <= conformance.TOL


def _tp2(rank, world, model_dir):

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trtllm_fake.install_in_process(V29)                 # seeds repeat (PR #17172): the same tokens after wake
    engine = TRTLLMEngine(model_dir, engine_cfg(tensor_model_parallel_size=2, load_format="dummy"),
                          tp_group=dist.group.WORLD, device=f"cpu:{rank}")
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    named = state_of(hf)
    _sync(engine, named)                       # each rank's handles keyed by its UUID; every worker finds its own
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.3, seed=4)
    groups = engine.generate(conformance.PROMPTS, sp)
    err = conformance.Oracle(hf).max_error(groups, conformance.PROMPTS, 1.3)
    engine.sleep()
    _sync(engine, named)
    engine.wake()
    again = engine.generate(conformance.PROMPTS, sp)
    workers = engine.llm.workers if engine.leader else None
    if engine.leader:                          # a failure inside TensorRT-LLM on the leader only
        engine.llm.generate = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory"))
    try:
        engine.generate(conformance.PROMPTS, sp)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    return ([[c.token_ids for c in g] for g in groups], [[c.token_ids for c in g] for g in again], err, workers,
            raised)


@pytest.mark.timeout(300)
def test_tp2_group_over_gloo(dirs):
    """Two ranks: the leader's fake workers sit on both ranks' GPUs, the gathered handles reach each,
    both ranks return the leader's completions, exact against transformers, across a sleep/sync/wake;
    a failure on the leader reaches the other rank."""
    from tests.distributed import run_ranks
    (t0, a0, err, workers, raised0), (t1, a1, _, _, raised1) = run_ranks(2, _tp2, (dirs["a"],))
    assert workers == ["GPU-fake-0", "GPU-fake-1"]
    assert raised0 == "CUDA error: out of memory"
    assert raised1 == "the rollout TP group's leader failed in TensorRT-LLM: RuntimeError: CUDA error: out of memory", \
        "the other rank gets the leader's error instead of waiting forever"
    assert t0 == t1 and a0 == a1 and t0 == a0
    assert err <= conformance.TOL


# -- benchmarks/trtllm_check.py, the GPU-node procedure ------------------------------------------------------------
def test_trtllm_check_exits_2_in_one_line_without_tensorrt_llm(tmp_path):
    import subprocess
    proc = subprocess.run([sys.executable, "benchmarks/trtllm_check.py", "--model", str(tmp_path),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensorrt_llm does not import here" in lines[0] and "pypi.nvidia.com" in lines[0]
    assert not (tmp_path / "out").exists(), "nothing is written before the check can run"


def test_trtllm_check_report_tables():
    from benchmarks import trtllm_check
    lead = {"ok": True, "features": "TensorRT-LLM 9.9", "workers": ["GPU-a"], "same_tokens_after_wake": True,
            "peak_gpu_gb": 1.5, "phases": {"build_engine": 12.0, "sleep": 0.5},
            "logprob_max_abs_diff_before_sleep": 0.01, "logprob_mean_abs_diff_before_sleep": 0.001,
            "logprob_max_abs_diff_after_wake": 0.02, "logprob_mean_abs_diff_after_wake": 0.002}
    report = {"date": "d", "versions": {"gpu": "H100"}, "runs": [
        {"tp": 1, "ok": True, "verdict": True, "ranks": [lead]},
        {"tp": 2, "ok": False, "verdict": False, "ranks": [{"ok": False, "error": "RuntimeError: boom"}]}]}
    md = trtllm_check.markdown(report)
    assert "## TP 1: passed" in md and "| build_engine | 12.000 | 12.000 |" in md and "| after_wake | 2.000e-02" in md
    assert "## TP 2: FAILED" in md and "RuntimeError: boom" in md


def _check_procedure(rank, world, model_dir):
    from benchmarks import trtllm_check
    trtllm_fake.install_in_process(V29)
    torch.set_num_threads(1)
    result = {"phases": {}}
    trtllm_check._phases(rank, world, model_dir, {"max_tokens": 6, "gpu_memory_utilization": 0.3}, result,
                         device="cpu")
    return result


@pytest.mark.timeout(300)
def test_trtllm_check_procedure_against_megatron_on_the_fake(tmp_path):
    """The check's procedure end to end on one CPU rank: a real megatron actor, the engine on the
    conformance fake (fp32, exact): log-probs equal megatron's before sleep and after the refit."""
    from megarl.models.tiny import make_tiny_hf
    from tests.distributed import run_ranks
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2", seed=1, vocab_size=301)
    (result,) = run_ranks(1, _check_procedure, (path,))
    assert result["same_tokens_after_wake"] and result["seed_repeats"] and result["equal_prompts_differ"]
    freed = result["gpu_freed_gb_per_tag"]
    assert freed["kv_cache"] > 0 and freed["model_weights"] > 0 and set(freed) >= {"model", "sampler"}
    assert result["gpu_used_gb_asleep"] == 0 < result["gpu_used_gb_awake"], "every tag leaves the GPU"
    assert result["logprob_max_abs_diff_before_sleep"] <= 1e-4 and result["logprob_max_abs_diff_after_wake"] <= 1e-4
    assert {"build_policy", "build_engine", "refit_first", "generate_before_sleep", "sleep", "refit_asleep", "wake",
            "generate_after_wake", "megatron_log_prob_after_wake"} <= set(result["phases"])
    assert result["workers"] == ["GPU-fake-0"]
    assert 0 <= result["eos_stop_rate"] <= 1 and "eos_ids" in result
