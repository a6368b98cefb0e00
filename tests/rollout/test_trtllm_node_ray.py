"""One Ray cluster per node for TensorRT-LLM's TP groups (megarl/rollout/trtllm/node_ray.py): the
leaders share the node's placement group and each group's workers land on its ranks' GPUs.

    python -m pytest -q tests/rollout/test_trtllm_node_ray.py

A real local Ray cluster on CPU; its GPUs are Ray's logical GPU resource (num_gpus=4), which Ray
assigns and reports (ray.get_gpu_ids) as it does physical ones. Beside it runs an unrelated Ray
(another user's or job's), which RAY_ADDRESS names: the job never joins it.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from megarl.rollout.trtllm import node_ray

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow           # three Ray clusters and their actors start
GPUS = 4


KEY = node_ray.job_key({"MASTER_ADDR": "test-node", "MASTER_PORT": str(os.getpid())})
# A Ray of someone else's on the machine: what address="auto" (and RAY_ADDRESS) would find.
UNRELATED = ("import ray, sys; ray.init(address='local', num_cpus=1, include_dashboard=False); "
             "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read(); ray.shutdown()")
AUTH = ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_ADDRESS")


def _leader(key: str) -> subprocess.CompletedProcess:
    """Another TP group's leader: a process of its own (without this one's Ray token) that connects."""
    code = ("import ray; from megarl.rollout.trtllm import node_ray; address = node_ray.connect(ray, %r, 4, 4); "
            "nb = node_ray.node_bundles(ray, %r); print(nb.pg.id.hex(), address)" % (key, key))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def cluster():
    """The job's cluster, started by this process as its first leader while an unrelated Ray runs
    on the machine and RAY_ADDRESS names it."""
    assert not ray.is_initialized()
    saved = {k: os.environ.get(k) for k in AUTH}
    other = subprocess.Popen([sys.executable, "-c", UNRELATED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        unrelated = other.stdout.readline().strip()
        assert unrelated, "the unrelated Ray did not start"
        os.environ["RAY_ADDRESS"] = unrelated
        address = node_ray.connect(ray, KEY, num_gpus=GPUS, num_cpus=GPUS)
        yield unrelated, address
    finally:
        ray.shutdown()
        other.stdin.close()
        other.wait(timeout=60)
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        for suffix in ("", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(node_ray._record_path(KEY) + suffix)


def test_bundle_plan_refuses_what_the_executor_refuses():
    assert node_ray.bundle_plan(["1", "0", "3", "2"], [2, 3]) == [3, 2]
    for share in (0, 1.5):
        with pytest.raises(ValueError, match="per_worker_gpu_share"):
            node_ray.bundle_plan(["0", "1"], [0], share)
    with pytest.raises(RuntimeError, match=r"needs \[5\]"):
        node_ray.bundle_plan(["0", "1"], [5])
    with pytest.raises(RuntimeError, match="one bundle each"):
        node_ray.bundle_plan(["0", "1"], [1, 1])


def test_the_job_key_tells_jobs_apart():
    one = {"SLURM_JOB_ID": "7", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert node_ray.job_key(one) == node_ray.job_key(dict(one))
    assert node_ray.job_key(one) != node_ray.job_key({**one, "SLURM_JOB_ID": "8"})
    assert node_ray.job_key(one) != node_ray.job_key({**one, "TORCHELASTIC_RESTART_COUNT": "1"})


def _where() -> list:
    return [str(g) for g in ray.get_gpu_ids()]


def test_the_job_starts_its_own_cluster_beside_an_unrelated_one(cluster):
    """RAY_ADDRESS and address="auto" lead to the unrelated Ray: the job's cluster is another one,
    and a second connect in this process attaches to nothing new."""
    unrelated, address = cluster
    assert ray.get_runtime_context().gcs_address == address != unrelated
    assert ray.cluster_resources().get("GPU") == GPUS
    assert node_ray.connect(ray, KEY) == address
    with pytest.raises(RuntimeError, match="not this job's TensorRT-LLM node cluster") as err:
        node_ray.connect(ray, node_ray.job_key({"MASTER_PORT": "1"}))
    assert "\n" not in str(err.value)


def test_groups_share_one_placement_group_and_land_on_their_gpus(cluster):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    first = node_ray.node_bundles(ray, KEY)
    second = node_ray.node_bundles(ray, KEY)
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


def test_the_jobs_other_leaders_attach_and_another_job_does_not(cluster):
    """A second leader of the job (another process, no token of its own) finds the job's cluster
    and placement group through the record; a leader of another job starts a cluster of its own."""
    unrelated, address = cluster
    first = node_ray.node_bundles(ray, KEY)
    out = _leader(KEY)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [first.pg.id.hex(), address]
    other_key = node_ray.job_key({"MASTER_ADDR": "test-node", "MASTER_PORT": "other"})
    try:
        out = _leader(other_key)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] not in (address, unrelated)
    finally:
        for suffix in ("", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(node_ray._record_path(other_key) + suffix)


class Where:
    """A pool actor that says which cluster it runs in."""

    def ready(self) -> bool:
        return True

    def cluster(self) -> str:
        return ray.get_runtime_context().gcs_address


def test_megarls_pools_run_in_the_jobs_cluster(cluster):
    """A reward or tool pool in a leader's process shares the job's cluster (megarl's token; it
    outlives every LLM) instead of refusing it."""
    from megarl.parallel.actor_pool import ActorPool, Job, ensure_ray
    _, address = cluster
    ensure_ray(1)
    pool = ActorPool(Where, 1)
    try:
        (done,) = pool.run([Job("cluster", (), timeout_s=120.0)])
    finally:
        pool.close()
    assert done.value == address and os.environ.get("RAY_AUTH_MODE") == "token"


def test_the_engine_places_its_workers_in_the_jobs_cluster(cluster, monkeypatch, tmp_path, one_torch_thread):
    """TRTLLMEngine on the fake tensorrt_llm and this real Ray: the fake executor (RayExecutor's
    create_workers) starts a real Ray actor in the bundle of the rank's GPU, which reports the GPU
    Ray gave it through the launcher's CUDA_VISIBLE_DEVICES as RayWorkerWrapper reads it."""
    from megarl.rollout.trtllm import TRTLLMEngine
    from tests.rollout import trtllm_fake
    from tests.rollout.fixtures import model_dirs, trtllm_config
    _, address = cluster
    dirs = model_dirs(str(tmp_path))
    trtllm_fake.install(monkeypatch, "trtllm-1.3.0rc29.json", real_ray=True)
    monkeypatch.setattr(node_ray, "job_key", lambda env: KEY)        # this module's job
    engine = TRTLLMEngine(dirs["a"], trtllm_config(), device="cpu:1")
    try:
        assert engine.llm.workers == ["GPU-fake-1"]
        assert engine.llm.kwargs["ray_placement_config"].placement_groups[0].id == node_ray.node_bundles(ray, KEY).pg.id
    finally:
        engine.close()
    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == address, "the cluster outlives the LLM"


class PlacementGroup:
    """Named as Ray's class: the fake's RayPlacementConfig checks the type by name."""


def test_the_fakes_placement_config_refuses_what_tensorrt_llm_refuses(monkeypatch):
    from tests.rollout import trtllm_fake
    monkeypatch.delenv("RAY_ADDRESS", raising=False)      # the module's unrelated Ray: not this test's
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
