"""The conformance fake enforces each validator of TensorRT-LLM that megarl's calls can reach, one
test per rule, each raising what the real one raises. The source of each rule is named beside it
(repository NVIDIA/TensorRT-LLM; the snapshot's "fields" records path and commit):
  sampling_params.py at b35ac1b (v1.2.0rc2), SamplingParams._validate: ranges, best_of, greedy n,
      truncate_prompt_tokens, logprobs coercion on 1.2 (messages verbatim);
  TensorRT-LLM's test_logprobs_simple_format_validation (index excerpt, no commit): the simple
      format needs logprobs == 0 and no beam search (the messages that test matches);
  megarl's REFERENCE.md sec. 4 (the issue author's reading of 1.3's _validate): True->0,
      False->None, logprobs_mode raw by default (type checked; our wording);
  executor/params/sampling.py at 1f064c46: the log-prob limit of 100 (messages verbatim);
  executor/ray/gpu_worker.py at a3dfe261: sleep without sleep_config, ExecutorMemoryType(tag),
      int(ray.get_gpu_ids()[0]) (messages verbatim or Python's own);
  llmapi/llm.py at 1f064c46, _TorchLLM._validate_args_for_torch_backend: an LLM keyword TorchLlmArgs
      lacks (message verbatim); pydantic's StrictBaseModel (extra="forbid"): the config classes'
      unknown keywords (pydantic's own ValidationError).
FAKES: tensorrt_llm cannot run here.
"""
from __future__ import annotations

import pydantic
import pytest

from tests.rollout import trtllm_fake

V12, V13 = "trtllm-1.2.0rc2.json", "trtllm-1.3.0rc21.json"


@pytest.fixture(params=[V12, V13])
def any_version(request, monkeypatch):
    return trtllm_fake.install(monkeypatch, request.param)


@pytest.fixture
def t13(monkeypatch):
    return trtllm_fake.install(monkeypatch, V13)


# -- SamplingParams._validate, common to both (b35ac1b) ---------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"top_p": 1.5}, r"require 0 <= top_p <= 1, got top_p=1.5"),
    ({"top_k": -1}, r"require top_k >= 0, got top_k=-1"),
    ({"temperature": -0.1}, r"require temperature >= 0, got temperature=-0.1"),
    ({"n": 2, "best_of": 1, "temperature": 1.0}, r"best_of \(1\) cannot be less than n \(2\)"),
    ({"n": 2, "temperature": 0.0}, r"Greedy decoding in the LLM API does not allow multiple returns"),
    ({"n": 2, "top_k": 1, "temperature": 1.0}, r"Greedy decoding"),                 # top_k=1 is greedy
    ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be >= 1, got 0"),
])
def test_sampling_params_ranges(any_version, kw, message):
    with pytest.raises(ValueError, match=message):
        any_version.SamplingParams(**kw)


def test_unknown_sampling_field_is_a_type_error(any_version):
    with pytest.raises(TypeError, match="unexpected keyword argument 'logits_mode'"):
        any_version.SamplingParams(logits_mode="raw")


def test_greedy_n_allowed_with_the_env_switch(any_version, monkeypatch):
    monkeypatch.setenv("TLLM_ALLOW_N_GREEDY_DECODING", "1")
    assert any_version.SamplingParams(n=2, temperature=0.0).best_of == 2


def test_logprobs_coercion_per_version(monkeypatch):
    t12 = trtllm_fake.install(monkeypatch, V12)
    assert t12.SamplingParams(logprobs=True).logprobs == 1, "1.2: `logprobs and int(logprobs)`"
    assert t12.SamplingParams(logprobs=False).logprobs is False
    t13 = trtllm_fake.install(monkeypatch, V13)
    assert t13.SamplingParams(logprobs=True).logprobs == 0, "1.3: True means the sampled token only"
    assert t13.SamplingParams(logprobs=False).logprobs is None


# -- 1.3's log-prob rules ----------------------------------------------------------------------------------
def test_logprobs_limit_of_100(t13):
    """check_logprobs_limit with MAX_TOP_LOGPROBS = 100 (executor/params/sampling.py at 1f064c46)."""
    assert t13.SamplingParams(logprobs=100).logprobs == 100
    with pytest.raises(ValueError, match="logprobs must be less than or equal to 100"):
        t13.SamplingParams(logprobs=101)
    with pytest.raises(ValueError, match="prompt_logprobs must be less than or equal to 100"):
        t13.SamplingParams(prompt_logprobs=101)
    with pytest.raises(ValueError, match="logprobs must be positive, zero or None"):
        t13.SamplingParams(logprobs=-1)


@pytest.mark.parametrize("logprobs", [1, 2, None])
def test_simple_format_needs_logprobs_zero(t13, logprobs):
    with pytest.raises(ValueError, match=r"logprobs_simple_format=True requires logprobs == 0"):
        t13.SamplingParams(logprobs=logprobs, logprobs_simple_format=True)
    assert t13.SamplingParams(logprobs=0, logprobs_simple_format=True).logprobs == 0


def test_prompt_simple_format_needs_prompt_logprobs_zero(t13):
    with pytest.raises(ValueError, match=r"prompt_logprobs_simple_format=True requires prompt_logprobs == 0"):
        t13.SamplingParams(prompt_logprobs=3, prompt_logprobs_simple_format=True)


def test_simple_format_refuses_beam_search(t13):
    with pytest.raises(ValueError, match="beam search"):
        t13.SamplingParams(logprobs=0, logprobs_simple_format=True, use_beam_search=True, best_of=2, n=2)


def test_logprobs_mode_defaults_to_raw_and_refuses_others(t13):
    assert str(t13.SamplingParams(logprobs=0).logprobs_mode) == "raw"
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        t13.SamplingParams(logprobs=0, logprobs_mode="logits")


def test_1_2_has_no_log_prob_mode_nor_simple_format(monkeypatch):
    t12 = trtllm_fake.install(monkeypatch, V12)
    for field in ("logprobs_mode", "logprobs_simple_format"):
        with pytest.raises(TypeError, match=field):
            t12.SamplingParams(**{field: None})


# -- LLM arguments (pydantic StrictBaseModel) ----------------------------------------------------------------
def test_unknown_llm_and_kv_cache_arguments(any_version):
    with pytest.raises(ValueError, match=r"not supported by the PyTorch backend: \['gpu_memory_utilization'\]"):
        any_version.LLM(model="x", gpu_memory_utilization=0.5)
    for model in (any_version.llmapi.llm_args.TorchLlmArgs, any_version.llmapi.KvCacheConfig):
        with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
            model(gpu_memory_utilization=0.5)


def test_sleep_switch_per_version(monkeypatch):
    t12 = trtllm_fake.install(monkeypatch, V12)
    with pytest.raises(ValueError, match="sleep_config"):
        t12.LLM(model="x", sleep_config=None)
    t13 = trtllm_fake.install(monkeypatch, V13)
    with pytest.raises(ValueError, match="enable_sleep"):
        t13.LLM(model="x", enable_sleep=True)


def test_sleep_config_takes_the_enums_tags_and_modes(t13):
    args = t13.llmapi.llm_args
    mem = args.ExecutorMemoryType
    assert {m.value for m in mem} >= {"model", "model_weights", "draft_model_weights", "kv_cache"}
    args.SleepConfig(restore_modes={mem("model_weights"): "NONE", mem("model"): "MEMSET"})
    with pytest.raises(ValueError, match="Input should be one of"):
        args.SleepConfig(restore_modes={mem("kv_cache"): "DISCARD"})
    with pytest.raises(ValueError, match="is not a valid ExecutorMemoryType"):
        args.SleepConfig(restore_modes={"weights": "NONE"})


# -- the Ray workers (executor/ray/gpu_worker.py) ---------------------------------------------------------------
def test_sleep_rpc_needs_sleep_config_and_known_tags(t13, tmp_path):
    from tests.rollout.fixtures import save_model
    save_model(str(tmp_path))
    llm = t13.LLM(model=str(tmp_path))
    with pytest.raises(ValueError, match="Sleep feature is not enabled, please set sleep_config"):
        llm._collective_rpc("sleep", (["kv_cache"],))
    mem = t13.llmapi.llm_args.ExecutorMemoryType
    llm = t13.LLM(model=str(tmp_path),
                  sleep_config=t13.llmapi.llm_args.SleepConfig(restore_modes={mem("kv_cache"): "NONE"}))
    with pytest.raises(ValueError, match="'weights' is not a valid ExecutorMemoryType"):
        llm._collective_rpc("sleep", (["weights"],))


def test_workers_parse_integer_gpu_ids(t13, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-2")
    with pytest.raises(ValueError, match="invalid literal for int"):
        t13.LLM(model="x")


def test_completion_output_fields(t13):
    fields = set(t13.CompletionOutput.__dataclass_fields__)
    assert {"additional_context_outputs", "additional_generation_outputs", "request_perf_metrics"} <= fields
    assert {"token_ids", "logprobs", "finish_reason"} <= fields
