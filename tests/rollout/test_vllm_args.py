"""vLLM's LLM arguments per device (megarl/rollout/vllm/args.py llm_kwargs) and the engine's
device-side state (bucket copies, sleep levels), without starting vLLM.

Every argument megarl passes is a field of vLLM's EngineArgs in two readings: the snapshot of
vllm/engine/arg_utils.py in tests/assets/vllm/ (repository, path and commit inside it) and the
installed build's own arg_utils.py, parsed, not imported (in-process vLLM patches torch).
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.rollout.config import RolloutConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128}
SNAPSHOTS = sorted(glob.glob(os.path.join(ROOT, "tests", "assets", "vllm", "engine_args-*.json")))


def _cfg(**keys) -> RolloutConfig:
    return RolloutConfig(name="vllm", **keys)


def _kwargs(cfg: RolloutConfig, device: str, user: dict | None = None, ram: int = 64 << 30) -> dict:
    from megarl.rollout.vllm.args import llm_kwargs
    return llm_kwargs(cfg, device_type=device, model_dir="/m", max_len=256, dtype="bfloat16", overrides={},
                      hf_config=HF, user=user or {}, total_ram=ram)


def test_cuda_takes_verl_keys_as_vllm_means_them():
    kw = _kwargs(_cfg(gpu_memory_utilization=0.6), "cuda", ram=0)
    assert kw["gpu_memory_utilization"] == 0.6 and "kv_cache_memory_bytes" not in kw    # vLLM sizes it on the GPU
    assert kw["enforce_eager"] is False                                  # verl's default: CUDA graphs
    assert kw["enable_sleep_mode"] is True                               # free_cache_engine's default
    assert _kwargs(_cfg(enforce_eager=True), "cuda")["enforce_eager"] is True
    off = _kwargs(_cfg(free_cache_engine=False, enable_sleep_mode=False), "cuda")
    assert off["enable_sleep_mode"] is False
    assert _kwargs(_cfg(free_cache_engine=False), "cuda")["enable_sleep_mode"] is True


def test_cpu_keeps_its_own_limits():
    cfg = _cfg(free_cache_engine=False, enable_sleep_mode=False, max_num_seqs=4)
    kw = _kwargs(cfg, "cpu")
    assert kw["enforce_eager"] is True and kw["enable_sleep_mode"] is False
    # 4 rows x (256 + 16) tokens x 2 (K, V) x 2 layers x 2 heads x 64 x 2 bytes
    assert kw["kv_cache_memory_bytes"] == 4 * 272 * 2 * 2 * 2 * 64 * 2
    assert "kv_cache_memory_bytes" not in _kwargs(cfg, "cpu", user={"kv_cache_memory_bytes": 1 << 30})
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization: =0.5: vLLM's KV cache .* more than 0.5 of this "
                                          r"host's"):
        _kwargs(cfg, "cpu", ram=1 << 20)


def test_another_device_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.device: is 'mps'"):
        _kwargs(_cfg(), "mps")


def _installed_fields() -> list[str] | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "engine", "arg_utils.py")
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_argument_is_an_engine_args_field(device):
    kw = _kwargs(_cfg(free_cache_engine=False, enable_sleep_mode=False), device)
    passed = set(kw) | {"distributed_executor_backend"}        # engine.py adds it under torch.distributed
    assert SNAPSHOTS, "no vLLM EngineArgs snapshot under tests/assets/vllm"
    for path in SNAPSHOTS:
        snap = json.load(open(path))
        assert snap["repo"] == "vllm-project/vllm" and len(snap["commit"]) == 40
        assert passed <= set(snap["engine_args_fields"]), (path, passed - set(snap["engine_args_fields"]))
    installed = _installed_fields()
    if installed is None:
        pytest.skip("vllm is not installed: the snapshot alone was checked")
    assert passed <= set(installed), passed - set(installed)


def test_owned_arguments_are_engine_args_fields():
    """engine_kwargs.vllm refuses what megarl sets (args.OWNED): each of those is a real field."""
    from megarl.rollout.vllm.args import OWNED
    for path in SNAPSHOTS:
        assert set(OWNED) <= set(json.load(open(path))["engine_args_fields"])


class _LLM:
    """vLLM's LLM.sleep / wake_up / reset_prefix_cache as vllm 0.32.0 declares them
    (vllm/entrypoints/llm.py; tags from v1/engine/core.py wake_up): a level or a tag vLLM does
    not know is refused."""
    TAGS = ("weights", "kv_cache", "scheduling")

    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1, mode: str = "abort"):
        assert level in (0, 1, 2) and mode in ("abort", "wait", "keep")
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        assert tags is None or set(tags) <= set(self.TAGS)
        self.calls.append(("wake_up", tags))
        return True

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    def collective_rpc(self, fn, args=()):
        self.calls.append((fn.__name__, *[[(n, t.device.type) for n, t in a] if isinstance(a, list) else a
                                          for a in args]))
        return [0]


def _engine(device: str, sleeps: bool):
    """The engine's state after __init__, on a recording LLM (its constructor needs vLLM itself)."""
    from megarl.rollout.vllm.engine import VLLMEngine
    from megarl.rollout.weight_state import WeightState
    engine = VLLMEngine.__new__(VLLMEngine)
    # "frozen" is a model tensor no sync writes: sleep keeps level 1 (its host copy must survive)
    engine.device, engine.llm, engine.shapes = torch.device(device), _LLM(), {"w": (2,), "frozen": (2,)}
    engine.weights, engine.asleep, engine.sleeps = WeightState(["w"], ready=True), False, sleeps
    engine._weights_awake, engine._reloading, engine._broken, engine._transfer = True, False, "", False
    return engine


def test_buckets_are_copied_to_the_engines_device():
    """On CUDA the bucket stays on the GPU; the meta device stands in for it here (a copy to the
    host would show as cpu)."""
    engine = _engine("meta", sleeps=False)
    engine.update_weights([("w", torch.ones(2))])
    assert ("load_bucket", [("w", "meta")]) in engine.llm.calls


def test_sleep_is_level_one_and_a_sync_wakes_the_weights_first():
    engine = _engine("cpu", sleeps=True)
    engine.sleep()
    engine.sleep()                                              # twice: once
    engine.update_weights([("w", torch.ones(2))])
    engine.finalize_weights()
    engine.wake()
    names = [c[0] for c in engine.llm.calls]
    assert engine.llm.calls[0] == ("sleep", 1) and names.count("sleep") == 1
    assert engine.llm.calls[1] == ("wake_up", ["weights"]) and names[2] == "begin_reload"
    assert engine.llm.calls[-2:] == [("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]
    assert not engine.asleep


def test_a_wake_without_a_sync_wakes_everything():
    engine = _engine("cpu", sleeps=True)
    engine.sleep()
    engine.wake()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", None), ("reset_prefix_cache",)]


def test_an_engine_without_sleep_mode_refuses_to_sleep():
    with pytest.raises(RuntimeError, match="no sleep mode"):
        _engine("cpu", sleeps=False).sleep()


def test_check_accepts_vllm_on_cuda_without_a_gpu_here(tmp_path, addition_model_dir):
    """`--check` with trainer.device=cuda: the GPU is listed as checked on the nodes, exit 0; the
    quickstart's heads of 32 (a CPU attention limit) and its sleep keys are accepted."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the login-node listing does not apply")
    out = subprocess.run([sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs",
                          "quickstart.yaml"), f"actor_rollout_ref.model.path={addition_model_dir}",
                          "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda", "--check"],
                         cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "trainer.device=cuda with rollout.name=vllm is checked on the nodes" in out.stdout + out.stderr
