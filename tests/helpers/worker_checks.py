"""Worker checks shared by the CPU tests (gloo) and tests/gpu (NCCL): the same function runs on
whatever device megarl picks, so a green CPU run proves the logic the GPU test runs.

    run_ranks(2, check_device_and_offload, (model_dir, "cpu"))    # tests/test_offload_device.py
    run_ranks(n, check_device_and_offload, (model_dir, "cuda"))   # tests/gpu/test_gpu.py
"""
from __future__ import annotations

import warnings

import torch


def make_batch(vocab: int, B: int, P: int, R: int, seed: int = 0):
    """A right-padded rollout batch with ragged prompt and response lengths (CPU tensors, as the
    rollout hands them over)."""
    from megarl.protocol import DataProto
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(1, R + 1, (B,), generator=g)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    resp = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        row = torch.randint(3, vocab, (int(plen[i] + rlen[i]),), generator=g)
        ids[i, :len(row)] = row
        resp[i, :int(rlen[i])] = row[int(plen[i]):]
    mask = (torch.arange(R).unsqueeze(0) < rlen.unsqueeze(1)).float()
    return DataProto.from_dict({"input_ids": ids, "prompt_lens": plen, "response_lens": rlen, "responses": resp,
                                "response_mask": mask, "advantages": torch.randn(B, R, generator=g),
                                "old_log_probs": torch.randn(B, R, generator=g) * 0.1 - 2.0})


def make_actor(path: str, tp: int = 1, micro: int = 2, mini: int = 4, **megatron):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    cfg = ActorConfig(ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro, optim=OptimConfig(lr=1e-3),
                      megatron=MegatronConfig(tensor_model_parallel_size=tp, **megatron))
    state.init_distributed()   # the rank set-up; the engine starts no process group
    return ActorWorker(ModelConfig(path=path), cfg)


class DeviceCheckingLoss:
    """A PPO-clip token-mean loss that records, per call, whether every tensor it is handed (the
    model's outputs and the whole micro-batch) sits on `device`."""

    def __init__(self, device: torch.device):
        self.device, self.misplaced = device, []

    def __call__(self, out, mb):
        for key, t in [*out.items(), *mb.batch.items()]:
            if t.device != self.device:
                self.misplaced.append((key, str(t.device)))
        ratio = (out["log_probs"] - mb.batch["old_log_probs"]).exp()
        adv, m = mb.batch["advantages"], mb.batch["response_mask"]
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        loss = (pg * m).sum() / mb.meta_info["global_tokens"]
        return loss, {"pg_loss": loss * mb.meta_info["global_micro_batches"], "ratio_mean": (ratio * m).sum() / m.sum()}


def _snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def check_device_and_offload(rank: int, world: int, path: str, want_device: str) -> dict:
    """On `world` ranks (DP = world, TP 1):
    - the engine runs on `want_device`, and every tensor the loss sees is on the model's device;
    - a micro-batch with a tensor on another device is refused, naming the key;
    - offload moves weights, grad buffers and optimizer state off the device (storages at 0 bytes,
      host copies holding the data) and onload brings them back bit-exact;
    - an actor trained through an offload/onload cycle matches one trained without (bitwise on
      CPU fp32; on CUDA, atomics in embedding backward allow tiny differences: compared closely).
    """
    from megarl.workers import batching
    a = make_actor(path)
    b = make_actor(path)
    eng = a.engine
    dev = eng.device
    assert dev.type == want_device, (dev, want_device)
    data = make_batch(a.spec.vocab_size, 8, 6, 5, seed=3)

    # 1. the loss sees device tensors only; forward_rows does too (the batch moved once)
    loss = DeviceCheckingLoss(dev)
    m1a = a.update_policy(data, loss)
    m1b = b.update_policy(data, DeviceCheckingLoss(dev))
    assert loss.misplaced == [], loss.misplaced

    # 2. a stray tensor on another device is refused before the model runs
    mb = batching.dp_slice(data, 0, 1)[:2].to(dev)
    mb.batch["advantages"] = mb.batch["advantages"].to("meta")
    try:
        eng.schedule.run([mb], batching.seq_len(mb), lambda out, m: {}, None)
        refused = None
    except RuntimeError as err:
        refused = str(err)
    assert refused and "'advantages'" in refused and "meta" in refused, refused

    # 3. offload / onload of everything, bit-exact
    params, grads, opt = eng.memory.param_tensors(), eng.memory.grad_tensors(), eng.memory.optimizer_tensors()
    assert params and grads and opt
    before = _snapshot(params + opt)
    resident = eng.resident_bytes()
    moved = eng.offload(params=True, grads=True, optimizer=True)
    left = eng.resident_bytes()
    all_empty = all(t.untyped_storage().nbytes() == 0 for t in params + grads + opt)
    host_copies = [h for _, h, _ in eng.memory.stash._held if h is not None]
    assert all_empty and left == 0 and moved == resident > 0, (all_empty, left, moved, resident)
    assert all(h.device.type == "cpu" for h in host_copies)
    eng.onload()
    assert _same(before, _snapshot(params + opt))
    assert all(float(g.abs().max()) == 0.0 for g in grads)   # grad buffers come back zeroed

    # 4. the next update (which onloads by itself after a second offload) matches the actor that never moved
    eng.offload(params=True, grads=True, optimizer=True)
    m2a = a.update_policy(data, DeviceCheckingLoss(dev))
    m2b = b.update_policy(data, DeviceCheckingLoss(dev))
    eng.offload(params=True, optimizer=True)
    lp_a, _ = a.compute_log_prob(data)          # onloads too
    lp_b, _ = b.compute_log_prob(data)
    wa = [t.float() for _, t in a.hf_tensors()]
    wb = [t.float() for _, t in b.hf_tensors()]
    if dev.type == "cpu":
        assert m1a == m1b and m2a == m2b, (m2a, m2b)
        assert torch.equal(lp_a, lp_b) and _same(wa, wb)
    else:
        for k in m2a:
            assert abs(m2a[k] - m2b[k]) <= 1e-2 * max(1.0, abs(m2b[k])), (k, m2a[k], m2b[k])
        assert (lp_a - lp_b).abs().max() < 5e-2
    # 5. the config keys: on CPU they warn once and do nothing; on CUDA they plan a move
    from megarl.workers.offload import offload_plan
    from megarl.workers.config import MegatronConfig
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = offload_plan(MegatronConfig(param_offload=True, optimizer_offload=True), "actor_rollout_ref.actor",
                            True, dev)
    if dev.type == "cpu":
        assert plan is None and any("no effect on cpu" in str(w.message) for w in caught)
    else:
        assert plan == {"params": True, "grads": False, "optimizer": True}
    return {"moved_bytes": moved, "metrics": m2a}


def check_weight_sync(rank: int, world: int, path: str, want_device: str) -> dict:
    """Megatron actor -> built-in engine on the same ranks (rollout TP 1): after one sync every
    element the engine holds equals the actor's HF export, and the engine's sampled log-probs
    match the actor's recomputation (fp32 CPU: 1e-4; bf16 CUDA: the per-token mismatch is
    bounded and reported, as the trainer logs it each step in rollout_corr/*)."""
    from megarl.algos.rollout_correction import rollout_mismatch_metrics
    from megarl.checkpoint_engine import build_checkpoint_engine
    from megarl.experiment import load_config
    from megarl.protocol import DataProto
    from megarl.rollout.base import SamplingParams
    from tests.helpers.checkpoint_engine import PROMPTS, TEMP, engine_mismatch, full_export, native_engine

    actor = make_actor(path)
    dev = actor.engine.device
    assert dev.type == want_device
    engine = native_engine(path, None, device=dev)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={path}", f"trainer.n_gpus_per_node={world}",
                             f"trainer.device={want_device}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.train_batch_size=4"])
    sync = build_checkpoint_engine(cfg, actor, engine, None)
    sync.sync()                                   # warm-up (allocations, first-touch)
    metrics = sync.sync()
    # all_gather_object unpickles CUDA tensors onto the sender's device index: bring them to ours
    expected = {k: v.to(dev) for k, v in full_export(actor).items()}
    worst, untouched = engine_mismatch(engine, expected)
    assert worst == 0.0 and untouched == [], (worst, untouched[:3])
    # every rank passes the same batch (seed 0): compute_log_prob gathers rows over DP
    batch = DataProto(non_tensor_batch={"prompt_token_ids": [list(p) * 4 for p in PROMPTS]},
                      meta_info={"sampling": SamplingParams(n=4, max_tokens=24, temperature=TEMP, seed=0)})
    out = engine.generate_sequences(batch)
    lp, _ = actor.compute_log_prob(out, temperature=TEMP, with_entropy=False)
    mism = rollout_mismatch_metrics(lp, out.batch["rollout_log_probs"], out.batch["response_mask"])
    if want_device == "cpu":
        assert mism["rollout_corr/max_abs_log_prob_diff"] < 1e-4, mism
    else:   # bf16 on both sides, different kernels: bounded, not equal
        assert mism["rollout_corr/k3_kl"] < 1e-2 and mism["training/rollout_probs_diff_mean"] < 2e-2, mism
    return {"sync": {k: v for k, v in metrics.items() if k.startswith("weight_sync/")}, "mismatch": mism}


def check_all(rank: int, world: int, path: str, want_device: str) -> dict:
    """Both checks in one spawn (each spawn costs seconds of start-up)."""
    return {"offload": check_device_and_offload(rank, world, path, want_device),
            "sync": check_weight_sync(rank, world, path, want_device)}
