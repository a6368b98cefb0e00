"""What crosses between the two sides of a disaggregated run, and how each side is built.

    parts = build_trainer_parts(cfg, ranks, log)    # trainer ranks: megatron roles + weight sender
    parts = build_rollout_parts(cfg, ranks, log)    # rollout ranks: engine + weight receiver (+ val reward)

Messages, all on groups created by setup_ranks before each side took its own default group:
    start      trainer rank 0 -> every rank (world_group): step to start from, data position,
               whether the checkpoint carried the in-flight batch
    update     trainer rank 0 -> the rollout ranks (a key in trainer rank 0's store): "version v is
               ready", so a partial rollout can stop between chunks; then the weight sync itself
               (checkpoint_engine.distributed: bucketed, all-or-nothing)
    hand-off   first rollout rank -> trainer ranks (handoff_group): the next batch, tagged with
               token versions, the data position after its prompts, and validation results
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist

from megarl.config.experiment import read_hf_config
from megarl.trainer.parts import Parts, total_steps


def _world_broadcast(obj, ranks, src_global: int, group=None):
    box = [obj]
    dist.broadcast_object_list(box, src=src_global, group=group if group is not None else ranks.world_group)
    return box[0]


def send_start(ranks, info: dict | None) -> dict:
    """Trainer rank 0's resume point to every rank of both sides."""
    return _world_broadcast(info, ranks, 0)


def handoff(ranks, payload: dict | None) -> dict:
    """The first rollout rank's payload to every trainer rank (rollout ranks other than the first
    are not in the group and do not call this)."""
    return _world_broadcast(payload, ranks, ranks.n_trainers, ranks.handoff_group)


class UpdateSignal:
    """Trainer rank 0 tells the rollout ranks that weights `version` are about to be synced.
    It goes through a key-value store of its own (a TCPStore served by trainer rank 0), which the
    rollout side can poll between chunks without blocking; a gloo irecv would not do (its
    completion shows only in wait()). The sync itself is the collective that lines both sides up.
    On one node the store listens on loopback only; across nodes on every interface, at a port
    published through the job's store (docs/security.md lists the ports)."""

    ADDRESS_KEY = "megarl/async/signal_address"

    def __init__(self, ranks, nnodes: int = 1):
        from megarl.parallel.loopback import listening_store
        self.store = None
        if ranks.role == "trainer" and ranks.rank == 0:
            host = "127.0.0.1" if nnodes == 1 else "0.0.0.0"
            self.store = listening_store(host)
            reach = "127.0.0.1" if nnodes == 1 else os.environ.get("MASTER_ADDR", socket.getfqdn())
            ranks.store.set(self.ADDRESS_KEY, f"{reach} {self.store.port}")
        elif ranks.role == "rollout":
            host, port = ranks.store.get(self.ADDRESS_KEY).decode().split()
            self.store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=300))

    @staticmethod
    def _key(version: int) -> str:
        return f"megarl/async/update/{version}"

    def send(self, version: int) -> None:          # trainer rank 0
        self.store.set(self._key(version), "1")

    def arrived(self, version: int) -> bool:       # rollout ranks
        return self.store.check([self._key(version)])

    def take(self, version: int) -> int:           # rollout ranks: wait until it arrives
        while not self.arrived(version):
            time.sleep(0.002)
        return version


def _ensure_model(cfg, ranks) -> dict:
    """Trainer rank 0 creates the checkpoint if asked; every rank of both sides waits for it."""
    from megarl.trainer.parts import ensure_model
    if ranks.role == "trainer":
        ensure_model(cfg, ranks)                   # rank 0 bootstraps; the trainer side waits
    dist.barrier(group=ranks.world_group)
    hf = read_hf_config(cfg.model.path)
    cfg.check_model(hf)
    return hf


def _common(cfg, ranks):
    from transformers import AutoTokenizer

    from megarl.data.build import build_loaders
    _ensure_model(cfg, ranks)
    m = cfg.model
    tokenizer = AutoTokenizer.from_pretrained(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_loader, val_loader = build_loaders(cfg.data, tokenizer)
    steps = total_steps(cfg, train_loader)
    for optim in (cfg.actor.optim, cfg.critic.optim):
        if optim.total_training_steps < 0:
            optim.total_training_steps = steps
    return tokenizer, pad, train_loader, val_loader, steps


def build_trainer_parts(cfg, ranks, log) -> Parts:
    from megarl.algos.kl import make_kl_controller
    from megarl.checkpoint_engine.distributed import DisaggregatedSender
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.reward.manager import build_reward_manager
    from megarl.workers.actor import ActorWorker
    from megarl.workers.critic import CriticWorker
    from megarl.workers.reference import ReferenceWorker

    tokenizer, pad, train_loader, val_loader, steps = _common(cfg, ranks)
    actor = ActorWorker.from_config(cfg)
    needs_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    ref = ReferenceWorker.from_config(cfg) if needs_ref else None
    critic = CriticWorker.from_config(cfg) if cfg.critic.enable else None
    source = ShardSource.from_actor(actor)
    # The engine side builds the same plan: tell it the dtype and head kind of the shards.
    _world_broadcast({"dtype": source.dtype, "head": source.head}, ranks, 0)
    sender = DisaggregatedSender(source, ranks.sync_groups, int(cfg.rollout.checkpoint_engine.bucket_size_mb * 2**20))
    reward = build_reward_manager(cfg, tokenizer) if ranks.is_main else None
    return Parts(tokenizer=tokenizer, pad_token_id=pad, train_loader=train_loader, val_loader=None,
                 actor=actor, ref=ref, critic=critic, rollout=None, weight_sync=sender, reward=reward,
                 reward_model=None, kl_ctrl=make_kl_controller(cfg.algorithm.kl_ctrl), total_steps=steps)


def build_rollout_parts(cfg, ranks, log) -> Parts:
    from megarl.algos.kl import make_kl_controller
    from megarl.checkpoint_engine.distributed import DisaggregatedReceiver
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.reward.manager import build_reward_manager
    from megarl.rollout.registry import build_rollout

    tokenizer, pad, train_loader, val_loader, steps = _common(cfg, ranks)
    engine = build_rollout(cfg.rollout, cfg.model.path, tokenizer, tp_group=ranks.rollout_group, device=ranks.device)
    info = _world_broadcast(None, ranks, 0)
    spec = HFCheckpoint(cfg.model.path).spec()
    receiver = DisaggregatedReceiver(engine, spec, ranks.sync_groups, info["dtype"],
                                     int(cfg.rollout.checkpoint_engine.bucket_size_mb * 2**20), head=info["head"],
                                     device=ranks.device, overlap=cfg.rollout.checkpoint_engine.overlap,
                                     keep_previous=cfg.rollout.checkpoint_engine.keep_previous_weights is not False)
    reward = build_reward_manager(cfg, tokenizer) if ranks.is_main and val_loader is not None else None
    return Parts(tokenizer=tokenizer, pad_token_id=pad, train_loader=train_loader, val_loader=val_loader,
                 actor=None, ref=None, critic=None, rollout=engine, weight_sync=receiver, reward=reward,
                 reward_model=None, kl_ctrl=make_kl_controller(cfg.algorithm.kl_ctrl), total_steps=steps)


__all__ = ["build_trainer_parts", "build_rollout_parts", "handoff", "send_start", "UpdateSignal"]
