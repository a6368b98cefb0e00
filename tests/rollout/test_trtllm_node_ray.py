"""One Ray cluster per node for TensorRT-LLM's TP groups (megarl/rollout/trtllm/node_ray.py): the
leaders share the node's placement group and each group's workers land on its ranks' GPUs.

    python -m pytest -q tests/rollout/test_trtllm_node_ray.py

A real local Ray cluster on CPU; its GPUs are Ray's logical GPU resource (num_gpus=4), which Ray
assigns and reports (ray.get_gpu_ids) as it does physical ones.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from megarl.rollout.trtllm import node_ray

ray = pytest.importorskip("ray")
GPUS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    assert not ray.is_initialized()
    ray.init(num_cpus=GPUS, num_gpus=GPUS, namespace=node_ray.NAMESPACE, include_dashboard=False)
    yield
    ray.shutdown()


def test_bundle_plan_refuses_what_the_executor_refuses():
    assert node_ray.bundle_plan(["1", "0", "3", "2"], [2, 3]) == [3, 2]
    for share in (0, 1.5):
        with pytest.raises(ValueError, match="per_worker_gpu_share"):
            node_ray.bundle_plan(["0", "1"], [0], share)
    with pytest.raises(RuntimeError, match=r"needs \[5\]"):
        node_ray.bundle_plan(["0", "1"], [5])
    with pytest.raises(RuntimeError, match="one bundle each"):
        node_ray.bundle_plan(["0", "1"], [1, 1])


def _where() -> list:
    return [str(g) for g in ray.get_gpu_ids()]


def test_groups_share_one_placement_group_and_land_on_their_gpus(cluster):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    node_ray.connect(ray, GPUS)                      # already attached: nothing new started
    first = node_ray.node_bundles(ray, GPUS, "job")
    second = node_ray.node_bundles(ray, GPUS, "job")
    assert first.pg.id == second.pg.id and sorted(first.gpus) == [str(i) for i in range(GPUS)]
    probe = ray.remote(num_gpus=1, num_cpus=0)(_where)
    for ordinals in ([2, 3], [0], [1]):
        indices = node_ray.bundle_plan(first.gpus, ordinals)
        got = ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=first.pg, placement_group_bundle_index=i)).remote() for i in indices])
        assert got == [[str(o)] for o in ordinals]
    # Ray itself refuses a bundle index past the group's end, as RayExecutor's workers would meet it
    with pytest.raises(ValueError):
        probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=first.pg, placement_group_bundle_index=GPUS)).remote()


def test_another_leader_attaches_to_the_same_cluster_and_group(cluster, tmp_path):
    """A second process (another TP group's leader) finds the node's Ray and the same group."""
    first = node_ray.node_bundles(ray, GPUS, "job")
    code = ("import ray; from megarl.rollout.trtllm import node_ray; node_ray.connect(ray, 4, %r); "
            "nb = node_ray.node_bundles(ray, 4, 'job'); print(nb.pg.id.hex(), ray.get_runtime_context().gcs_address)"
            % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pg_hex, address = out.stdout.split()[-2:]
    assert pg_hex == first.pg.id.hex() and address == ray.get_runtime_context().gcs_address


class PlacementGroup:
    """Named as Ray's class: the fake's RayPlacementConfig checks the type by name."""


def test_the_fakes_placement_config_refuses_what_tensorrt_llm_refuses(monkeypatch):
    from tests.rollout import trtllm_fake
    args = trtllm_fake.install(monkeypatch, "trtllm-1.3.0rc29.json").llmapi.llm_args
    nb = node_ray.NodeBundles(PlacementGroup(), ("0", "1", "2", "3"))
    cfg = node_ray.placement_kwargs(args, nb, [3, 1])["ray_placement_config"]
    assert cfg.placement_bundle_indices == [[3, 1]] and cfg.per_worker_gpu_share == 1.0
    with pytest.raises(ValueError, match="provided together"):
        args.RayPlacementConfig(placement_groups=[nb.pg])
    with pytest.raises(ValueError, match="must equal placement_bundle_indices length"):
        args.RayPlacementConfig(placement_groups=[nb.pg], placement_bundle_indices=[[0], [1]])
    with pytest.raises(TypeError, match="must be a Ray PlacementGroup"):
        args.RayPlacementConfig(placement_groups=["pg"], placement_bundle_indices=[[0]])
    with pytest.raises(ValueError, match="between 0 and 1.0"):
        args.RayPlacementConfig(per_worker_gpu_share=1.5)
    bad = args.RayPlacementConfig(placement_groups=[nb.pg], placement_bundle_indices=[[0]])
    llm = trtllm_fake.build("trtllm-1.3.0rc29.json")["tensorrt_llm"].LLM
    with pytest.raises(ValueError, match=r"Total bundle indices \(1\) must equal world_size \(2\)"):
        llm(model="unused", tensor_parallel_size=2, ray_placement_config=bad)
