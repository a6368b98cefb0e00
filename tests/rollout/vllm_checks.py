"""Everything tests/rollout/test_vllm.py asks of vLLM, in one process (vLLM's import and start-up
cost about a minute on 2 cores, paid once; in-process vLLM also patches torch for the whole process):

    TORCHDYNAMO_DISABLE=1 python tests/rollout/vllm_checks.py OUT_DIR     # writes OUT_DIR/results.json
    ... vllm_checks.py OUT_DIR routes_equal_transformers_and_replay        # only the named checks (of root)

  - the rollout contract (tests/rollout/conformance.py) on rollout.name=vllm;
  - the traps an adapter falls into, each shown to fail its check when the adapter steps in it:
    raw log-probs at T != 1, one reload per bucket when a bucket splits q/k/v or gate/up, no prefix
    cache reset after a sync (prompts of 128+ tokens then reuse KV of the old weights);
  - parity with megatron: the engine's sampled-token log-probs against the actor's
    compute_log_prob on the same tokens (fp32), through the colocated checkpoint engine's bucket
    stream, before and after three weight syncs with policy updates between them;
  - routing replay (R3) on a tiny MoE: vLLM's recorded experts against transformers' router, and
    megatron replaying them to vLLM's log-probs.

Each check's outcome is recorded by name (ok, its figures, or the error), so one failing check
never hides the others.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")       # vLLM's first generate compiles a sampling function otherwise
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megarl.rollout.base import SamplingParams  # noqa: E402
from megarl.rollout.config import RolloutConfig  # noqa: E402
from megarl.rollout.registry import build_rollout  # noqa: E402
from megarl.rollout.vllm import worker  # noqa: E402
from megarl.rollout.vllm.engine import VLLMEngine  # noqa: E402
from tests.rollout import conformance  # noqa: E402
from tests.rollout.fixtures import (PARITY_PROMPTS, PARITY_TEMPERATURE, in_buckets, model_dirs,  # noqa: E402
                                    policy_loss, state_of)

# vLLM's CPU attention takes head sizes of 64 and more: hidden 128 over 2 heads.
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
BASE = dict(free_cache_engine=False, enable_sleep_mode=False, prompt_length=200, response_length=16, max_num_seqs=16)


def config(**overrides) -> RolloutConfig:
    return RolloutConfig(name="vllm", load_format="auto", **{**BASE, **overrides})


# -- the traps: the pooled engine made to step in one -------------------------------------------
def raw_logprobs(engine) -> None:
    """vLLM's default log-probs (raw: before temperature) whatever the temperature."""
    engine.logprob_mode = lambda sampling: "raw"


def reload_per_bucket(engine) -> None:
    """vLLM's worker.reload_weights once per bucket: each call finalizes whatever layers it touched."""
    def update_weights(bucket):
        engine.weights.begin_bucket()
        named = [(n, t.detach().clone()) for n, t in bucket]
        engine._rpc(lambda w, named: w.model_runner.reload_weights(weights_iterator=iter(named)), named)
        for n, _ in named:
            engine.weights.received(n)

    def finalize_weights():
        engine.llm.reset_prefix_cache()
        engine.weights.finalize()
    engine.update_weights, engine.finalize_weights = update_weights, finalize_weights


def no_cache_reset(engine) -> None:
    """A sync that forgets to reset vLLM's prefix cache."""
    def end_reload():
        if engine._reloading:
            engine._reloading = False
            engine._rpc(worker.finish_reload)
    engine._end_reload = end_reload


class Pool:
    """make(**config) as the conformance checks call it. Starting vLLM costs seconds, so a call
    without overrides returns one pooled engine made fresh again: trap overrides removed and a
    full sync of weights A (which also resets its prefix cache)."""

    def __init__(self, dirs):
        self.dirs, self.engine = dirs, None

    def __call__(self, trap=None, **overrides) -> VLLMEngine:
        if overrides:
            return VLLMEngine(self.dirs["a"], config(**overrides))
        if self.engine is None:
            self.engine = VLLMEngine(self.dirs["a"], config())
        e = self.engine
        for name in ("logprob_mode", "update_weights", "finalize_weights", "_end_reload"):
            e.__dict__.pop(name, None)
        if e.weights.state == "updating":
            e.abort_weight_update()
        conformance._sync(e, state_of(self.dirs["model_a"]))
        if trap is not None:
            trap(e)
        return e


# -- checks -------------------------------------------------------------------------------------
def check_sync_splitting_layers(engine, dirs) -> dict:
    """One tensor per bucket: every bucket boundary splits q/k/v and gate/up. After the sync the
    greedy tokens and the log-probs are the new weights'."""
    oracle = conformance.Oracle(dirs["model_b"])
    named = state_of(dirs["model_b"])
    for bucket in in_buckets(named, len(named)):
        engine.update_weights(bucket)
    engine.finalize_weights()
    groups = engine.generate(conformance.PROMPTS, SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=2))
    err = oracle.max_error(groups, conformance.PROMPTS, 0.9)
    assert err <= conformance.TOL, f"after a sync of one tensor per bucket, log-probs are {err:.2e} off"
    return {"split_bucket_sync_max_abs_err": err}


def check_prefix_cache_after_sync(engine, dirs) -> dict:
    """A 160-token prompt generated before a sync (its KV blocks stay cached) and again after it:
    the second answer must be the new weights' greedy answer with their log-probs."""
    prompt = [(7 * i + 3) % 90 + 2 for i in range(160)]
    greedy = SamplingParams(max_tokens=8, do_sample=False)
    engine.generate([prompt], greedy)
    conformance._sync(engine, state_of(dirs["model_b"]))
    got = engine.generate([prompt], greedy)[0][0]
    oracle = conformance.Oracle(dirs["model_b"])
    err = oracle.max_error([[got]], [prompt], 1.0)
    assert got.token_ids == oracle.greedy(prompt, 8) and err <= conformance.TOL, \
        f"after a sync a cached 160-token prompt decoded {got.token_ids} with log-probs {err:.2e} off"
    return {"long_prompt_after_sync_max_abs_err": err}


def check_failed_bucket_refuses_then_recovers(engine, dirs) -> dict:
    """A sync that fails after its first bucket (a tensor of the wrong shape, refused before vLLM
    sees it; the transport then aborts): the engine refuses to generate rather than serve a mix,
    and the next full sync brings it back, exact."""
    import pytest
    named = state_of(dirs["model_b"])
    engine.update_weights(named[:3])
    bad = [(n, t[..., :-1].contiguous() if t.dim() == 2 else t) for n, t in named[3:6]]
    with pytest.raises(ValueError, match="does not match the model's"):
        engine.update_weights(bad)
    engine.abort_weight_update()                           # what the checkpoint engine does on a failure
    with pytest.raises(RuntimeError, match="did not receive a complete weight update"):
        engine.generate(conformance.PROMPTS[:1], SamplingParams(max_tokens=4, do_sample=False))
    conformance._sync(engine, named)
    oracle = conformance.Oracle(dirs["model_b"])
    groups = engine.generate(conformance.PROMPTS, SamplingParams(n=1, max_tokens=8, do_sample=False))
    assert [g[0].token_ids for g in groups] == [oracle.greedy(p, 8) for p in conformance.PROMPTS]
    return {"after_failed_bucket_logprob_max_abs_err": oracle.max_error(groups, conformance.PROMPTS, 1.0)}


def trap(name, step_in, check, make, dirs, results):
    """The check must fail on an engine that steps in the trap, or the check proves nothing."""
    try:
        check(make(trap=step_in), dirs)
    except AssertionError as err:
        results[f"trap_{name}"] = {"ok": True, "caught": str(err).splitlines()[0][:300]}
        return
    except BaseException as err:                           # noqa: BLE001 - recorded, the next check runs
        results[f"trap_{name}"] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        return
    results[f"trap_{name}"] = {"ok": False, "error": f"{check.__name__} passed on an engine with {step_in.__name__}"}


def run(name, fn, results):
    t = time.perf_counter()
    try:
        figures = fn() or {}
        results[name] = {"ok": True, "seconds": round(time.perf_counter() - t, 1), **figures}
    except BaseException as err:                           # noqa: BLE001 - recorded, the next check runs
        results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
    print(name, json.dumps(results[name])[:400], flush=True)


PROMPTS, TEMP, _policy_loss = PARITY_PROMPTS, PARITY_TEMPERATURE, policy_loss


def parity_with_megatron(root: str) -> dict:
    """Actor (megatron-core, TP1) and engine (load_format=dummy: weights only from syncs) in this
    process; each step: the colocated checkpoint engine syncs, the engine generates, the actor
    scores the same tokens, a policy update moves the weights."""
    import torch.distributed as dist
    from megarl.checkpoint_engine.colocated import ColocatedSync
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.models.tiny import make_tiny_hf
    from megarl.protocol import DataProto
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig

    # model.override_config (rms_norm_eps 0.5 over the checkpoint's 1e-6) on both sides: parity holds
    # only if vLLM builds its model with it (megarl passes it as vLLM's hf_overrides).
    path = make_tiny_hf(os.path.join(root, "parity"), "qwen2", seed=1, vocab_size=301, rms_norm_eps=1e-6, **SHAPE)
    override = {"model_config": {"rms_norm_eps": 0.5}}
    state.init_distributed()   # the rank set-up (megatron's CPU layer); the engine starts no process group
    actor = ActorWorker(ModelConfig(path=path, override_config=override), ActorConfig(
        ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=4, megatron=MegatronConfig(tensor_model_parallel_size=1),
        optim=OptimConfig(lr=3e-2)))
    assert dist.is_initialized() and dist.get_world_size() == 1
    engine = build_rollout(RolloutConfig(name="vllm", **{**BASE, "prompt_length": 16}), path, override_config=override)
    assert engine.llm.model_config.hf_config.rms_norm_eps == 0.5, "the override did not reach vLLM's model config"
    sync = ColocatedSync(ShardSource.from_actor(actor), engine, bucket_bytes=48 << 10)   # buckets split layers
    errors, first = [], None
    for step in range(4):                                  # the first sync brings the weights, three more follow
        sync.sync()
        sp = SamplingParams(n=2, max_tokens=8, temperature=TEMP, seed=step)
        batch = engine.generate_sequences(DataProto(non_tensor_batch={"prompt_token_ids": PROMPTS},
                                                    meta_info={"sampling": sp}))
        log_probs, _ = actor.compute_log_prob(batch, temperature=TEMP, with_entropy=False)
        mask = batch.batch["response_mask"].bool()
        errors.append((log_probs.cpu() - batch.batch["rollout_log_probs"])[mask].abs().max().item())
        first = first or batch.batch["responses"].tolist()
        batch.batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None].expand_as(log_probs).contiguous()
        actor.update_policy(batch, _policy_loss, TEMP)
    assert batch.batch["responses"].tolist() != first, "the policy updates did not change what vLLM samples"
    assert max(errors) <= 1e-5, f"vLLM vs megatron log-probs per sync: {errors}"
    return {"megatron_parity_max_abs_err_per_sync": errors, "rms_norm_eps_override": 0.5}


def _hf_routes(model, seq: list[int]) -> torch.Tensor:
    """transformers' top-2 experts at every position of seq: [T, MoE layers, 2]."""
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_router_logits=True)
    return torch.stack([g.float().softmax(-1).topk(2, dim=-1).indices for g in out.router_logits], 1)


def routes_equal_transformers_and_replay(root: str) -> dict:
    """R3 on vLLM (tiny Qwen3-MoE, 3 layers, 4 experts, top-2): every fed position's recorded experts
    equal transformers' router top-k on the same sequence, in order; megatron's actor under R3
    replays them and its log-probs equal vLLM's; the same batch with every expert id moved by one
    gives other log-probs, so the replay is what made them equal."""
    from transformers import AutoModelForCausalLM
    from megarl.models.tiny import make_tiny_hf
    from megarl.protocol import DataProto
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig, RouterReplayConfig
    path = make_tiny_hf(os.path.join(root, "moe"), "qwen3_moe", seed=1, vocab_size=301, num_hidden_layers=3,
                        tokenizer=False, **SHAPE)
    cfg = RolloutConfig(name="vllm", **{**BASE, "prompt_length": 24, "max_num_seqs": 6},
                        enable_rollout_routing_replay=True, load_format="auto")
    engine = build_rollout(cfg, path)
    assert not engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    prompts = PROMPTS + [[(5 * i + 1) % 290 + 3 for i in range(21)]]
    sp = SamplingParams(n=3, max_tokens=10, temperature=TEMP, seed=3, stop_token_ids=list(range(3, 40)))
    batch = engine.generate_sequences(DataProto(non_tensor_batch={"prompt_token_ids": prompts},
                                                meta_info={"sampling": sp}))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routes, lengths = batch.batch["routed_experts"], set()
    for i in range(len(batch)):
        n = int(batch.batch["prompt_lens"][i] + batch.batch["response_lens"][i])
        want = _hf_routes(hf, batch.batch["input_ids"][i, :n].tolist())
        assert routes.dtype == torch.uint8 and torch.equal(routes[i, :n - 1].long(), want[:n - 1]), f"sequence {i}"
        lengths.add(int(batch.batch["response_lens"][i]))
    assert len(lengths) > 1, "every sample ran to max_tokens: the stop ids did not vary the lengths"
    actor = ActorWorker(ModelConfig(path=path, override_config={"router_aux_loss_coef": 0.0}), ActorConfig(
        ppo_mini_batch_size=5, ppo_micro_batch_size_per_gpu=5, megatron=MegatronConfig(tensor_model_parallel_size=1),
        optim=OptimConfig(lr=1e-3), router_replay=RouterReplayConfig(mode="R3")))
    mask = batch.batch["response_mask"].bool()
    log_probs, _ = actor.compute_log_prob(batch, temperature=TEMP, with_entropy=False)
    err = (log_probs.cpu() - batch.batch["rollout_log_probs"])[mask].abs().max().item()
    assert err <= 1e-5, f"megatron replaying vLLM's routes: log-probs {err:.2e} off vLLM's"
    batch.batch["routed_experts"] = (routes + 1) % 4
    moved, _ = actor.compute_log_prob(batch, temperature=TEMP, with_entropy=False)
    moved_err = (moved.cpu() - batch.batch["rollout_log_probs"])[mask].abs().max().item()
    assert moved_err > 1e-3, f"routes moved by one expert changed the replayed log-probs by only {moved_err:.2e}"
    # A policy update, its weights synced through the colocated bucket stream (buckets split the
    # expert tensors of a layer), and the same comparison again: vLLM's MoE reload must repack the
    # experts for its CPU kernel (worker._prepack_cpu_experts) and the router hooks must survive it.
    from megarl.checkpoint_engine.colocated import ColocatedSync
    from megarl.checkpoint_engine.source import ShardSource
    batch.batch["routed_experts"] = routes
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None].expand_as(log_probs).contiguous()
    actor.update_policy(batch, _policy_loss, TEMP)
    ColocatedSync(ShardSource.from_actor(actor), engine, bucket_bytes=16 << 10).sync()
    after = engine.generate_sequences(DataProto(non_tensor_batch={"prompt_token_ids": prompts},
                                                meta_info={"sampling": sp.with_(seed=4)}))
    log_probs, _ = actor.compute_log_prob(after, temperature=TEMP, with_entropy=False)
    mask = after.batch["response_mask"].bool()
    synced_err = (log_probs.cpu() - after.batch["rollout_log_probs"])[mask].abs().max().item()
    assert synced_err <= 1e-5, f"after a weight sync, megatron replaying vLLM's routes is {synced_err:.2e} off"
    return {"sequences": len(batch), "response_lengths": sorted(lengths), "replay_max_abs_err": err,
            "moved_routes_max_abs_err": moved_err, "after_sync_replay_max_abs_err": synced_err}


def process_left_intact(engine) -> dict:
    """What in-process vLLM changes for the whole process is put back: torch.set_num_threads acts,
    and the trainer's process group is still up."""
    import torch.distributed as dist
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    now = torch.get_num_threads()
    torch.set_num_threads(before)
    assert now == 1, "torch.set_num_threads is still vLLM's no-op"
    assert dist.is_initialized(), "torch.distributed's default group is gone"
    return {}


def benchmark_peer(out_dir: str) -> dict:
    """benchmarks/rollout_throughput.py's vLLM peer (through megarl's adapter) at a tiny shape: its
    rows pass the contract check, its log-probs equal transformers', and it is timed beside native."""
    import contextlib
    import io
    from benchmarks.rollout_throughput import main as bench
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench(["--model-dir", os.path.join(out_dir, "toy"), "--vocab-size", "600", "--layers", "2", "--hidden", "128",
               "--heads", "2", "--kv-heads", "1", "--intermediate", "256", "--prompts", "3", "--n", "2",
               "--max-tokens", "8", "--repeats", "1", "--threads", "1", "--shortest", "4", "--longest", "12",
               "--no-plain"])
    text = out.getvalue()
    assert "vllm check: 6 rows (expected 3 x n=2 = 6)" in text and "0 with a stop id inside" in text, text
    diff = float(text.split("max |diff| ")[1].split(",")[0])
    assert diff <= 1e-5 and "ratio native / vllm" in text, text
    return {"benchmark_vllm_logprob_max_abs_err": diff}


def main(out_dir: str, only: list[str] | None = None) -> int:
    import torch.distributed as dist
    from tests.distributed import free_port
    # One gloo rank, as a training run's rank would have: megatron's actor needs it, and every vLLM
    # engine here then finds torch.distributed up (world 1) as it does inside megarl-train.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    dist.init_process_group("gloo")
    results: dict = {}
    if only:                                               # a named subset, for working on one check
        for name in only:
            fn = globals()[name]
            run(name, lambda f=fn: f(out_dir), results)
        return _write(out_dir, results)
    # First, as in a training run: megatron's actor and vLLM's engine in one process. The MoE engine
    # comes first: vLLM builds its parallel groups once per process, its expert-parallel group only
    # for an MoE model (a process of megarl's holds one engine).
    run("routes_equal_transformers_and_replay", lambda: routes_equal_transformers_and_replay(out_dir), results)
    run("parity_with_megatron", lambda: parity_with_megatron(out_dir), results)
    dirs = model_dirs(os.path.join(out_dir, "models"), **SHAPE)
    make = Pool(dirs)
    for check in conformance.CHECKS:
        run(check.__name__, lambda c=check: c(make, dirs), results)
    run("check_sync_splitting_layers", lambda: check_sync_splitting_layers(make(), dirs), results)
    run("check_prefix_cache_after_sync", lambda: check_prefix_cache_after_sync(make(), dirs), results)
    run("check_failed_bucket_refuses_then_recovers", lambda: check_failed_bucket_refuses_then_recovers(make(), dirs),
        results)
    trap("raw_logprobs", raw_logprobs, lambda e, d: conformance.check_sampled_logprobs(lambda **_: e, d), make, dirs,
         results)
    trap("reload_per_bucket", reload_per_bucket, check_sync_splitting_layers, make, dirs, results)
    trap("no_prefix_cache_reset", no_cache_reset, check_prefix_cache_after_sync, make, dirs, results)
    run("benchmark_peer", lambda: benchmark_peer(out_dir), results)
    run("process_left_intact", lambda: process_left_intact(make()), results)
    return _write(out_dir, results)


def _write(out_dir: str, results: dict) -> int:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
