"""TRTLLMEngine starts its LLM in the job's Ray cluster on the node (megarl/rollout/trtllm/node_ray.py):
the workers take the bundles of the node's placement group that hold the group's GPUs, the cluster
outlives the LLM, and TLLM_RAY_FORCE_LOCAL_CLUSTER=1, set by the user, keeps a Ray per group.

    python -m pytest -q tests/rollout/test_trtllm_node_cluster.py

FAKES: tensorrt_llm and (here) Ray, both as strict as their sources (trtllm_fake.py,
trtllm_fake_ray.py); tests/rollout/test_trtllm_node_ray.py runs the node cluster on a real Ray.
"""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.rollout.trtllm import TRTLLMEngine
from tests.rollout import trtllm_fake
from tests.rollout.fixtures import trtllm_config

V29 = "trtllm-1.3.0rc29.json"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tp2_on_gpus_2_and_3(rank, world, model_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    trtllm_fake.install_in_process(V29)
    engine = TRTLLMEngine(model_dir, trtllm_config(tensor_model_parallel_size=2), tp_group=dist.group.WORLD,
                          device=f"cpu:{rank + 2}")
    if not engine.leader:
        return None
    ray, llm = sys.modules["ray"], engine.llm
    seen = {"workers": llm.workers, "indices": llm.kwargs["ray_placement_config"].placement_bundle_indices,
            "clusters": len(ray.node), "inits": [i["address"] for i in ray.state["inits"]],
            "worker_env": {k: llm.worker_env.get(k) for k in ("TLLM_RAY_FORCE_LOCAL_CLUSTER", "CUDA_VISIBLE_DEVICES")}}
    engine.close()
    seen["ray_after_close"] = ray.is_initialized()
    return seen


@pytest.mark.timeout(300)
def test_a_tp2_group_takes_the_bundles_of_its_gpus_in_the_nodes_cluster(dirs):
    """Ranks on GPUs 2 and 3: the leader starts the job's cluster (every GPU of the node), the LLM
    gets bundles [2, 3] through ray_placement_config, its executor's ray.init finds the process
    attached and starts nothing, and each worker lands on its rank's GPU. The workers keep the
    launcher's CUDA_VISIBLE_DEVICES: with the group's "2,3" Ray would map both to GPU 2."""
    from tests.distributed import run_ranks
    seen, _ = run_ranks(2, _tp2_on_gpus_2_and_3, (dirs["a"],))
    assert seen["workers"] == ["GPU-fake-2", "GPU-fake-3"]
    assert seen["indices"] == [[2, 3]] and seen["clusters"] == 1 and seen["inits"] == ["local"]
    assert seen["worker_env"] == {"TLLM_RAY_FORCE_LOCAL_CLUSTER": None, "CUDA_VISIBLE_DEVICES": None}
    assert seen["ray_after_close"], "the node's cluster outlives the LLM"


def test_a_launchers_visible_devices_map_through_the_nodes_cluster(monkeypatch, dirs):
    """Slurm's CUDA_VISIBLE_DEVICES=4,5,6,7: the cluster holds those four GPUs, the rank on cuda:1
    is physical GPU 5, and its worker (Ray slot 1, mapped through the same list) runs there."""
    trtllm_fake.install(monkeypatch, V29)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu:1")
    ray = sys.modules["ray"]
    assert engine.llm.workers == ["GPU-fake-5"] and ray.cluster_resources()["GPU"] == 4
    assert engine.llm.kwargs["ray_placement_config"].placement_bundle_indices == [[1]]
    second = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu:3")    # another group, same process
    assert second.llm.workers == ["GPU-fake-7"] and len(ray.node) == 1, "one cluster, not one per group"
    engine.close()
    second.close()


def test_an_explicit_force_local_cluster_keeps_a_ray_per_group(monkeypatch, dirs, caplog):
    """The user's TLLM_RAY_FORCE_LOCAL_CLUSTER=1: the LLM starts a Ray of its own on the group's GPUs
    (no placement), the log says so, and the LLM shuts it down."""
    trtllm_fake.install(monkeypatch, V29)
    monkeypatch.setenv("TLLM_RAY_FORCE_LOCAL_CLUSTER", "1")
    with caplog.at_level(logging.INFO, logger="megarl.rollout.trtllm.engine"):
        engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu:6")
    assert any("TLLM_RAY_FORCE_LOCAL_CLUSTER=1" in r.getMessage() and "one per group" in r.getMessage()
               for r in caplog.records)
    ray = sys.modules["ray"]
    assert "ray_placement_config" not in engine.llm.kwargs and engine.llm.workers == ["GPU-fake-6"]
    assert engine.llm.worker_env["CUDA_VISIBLE_DEVICES"] == "6" and ray.state["inits"][-1]["address"] == "local"
    engine.close()
    assert not ray.is_initialized() and ray.state["shutdowns"] == 1


def test_a_placement_in_engine_kwargs_is_refused_in_one_line(monkeypatch, dirs):
    trtllm_fake.install(monkeypatch, V29)
    cfg = trtllm_config(engine_kwargs={"trtllm": {"ray_placement_config": {"per_worker_gpu_share": 0.5}}})
    with pytest.raises(ConfigError, match="engine_kwargs.trtllm.ray_placement_config is megarl's") as err:
        TRTLLMEngine(dirs["a"], cfg, device="cpu")
    assert "\n" not in str(err.value) and not sys.modules["ray"].is_initialized(), "refused before any Ray starts"
    assert "TLLM_RAY_FORCE_LOCAL_CLUSTER" not in os.environ
