"""A rollout rank's stream worker on a real built-in engine, in one process, with the trainer's half
of the bridge played by the test (tests/test_async_pieces.py, tests/test_stream_paced.py)."""
import pickle

import pytest
import torch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf
    return make_tiny_hf(str(tmp_path_factory.mktemp("partial") / "qwen2"), "qwen2", seed=3, vocab_size=301,
                        tokenizer=False)


def native_engine(path):
    from transformers import AutoModelForCausalLM

    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.registry import build_rollout
    engine = build_rollout(RolloutConfig(name="native", dtype="float32"), path)
    engine.update_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict().items())
    engine.finalize_weights()
    return engine


def rollout_worker(engine, overrides):
    """A RolloutWorker of one rollout rank (no torch.distributed), on a real native engine."""
    from megarl.experiment import load_config
    from megarl.parallel.state import Layout
    from megarl.rollout.sampling import train_sampling
    from megarl.trainer.stream.worker import RolloutWorker
    from megarl.trainer.loop.parts import RolloutParts
    from megarl.job.ranks import Ranks

    cfg = load_config(None, ["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.response_length=4",
                             *overrides])
    w = RolloutWorker.__new__(RolloutWorker)
    w.cfg, w.acfg, w.version = cfg, cfg.async_training, 3
    w.p = RolloutParts(tokenizer=None, pad_token_id=0, train_loader=None, val_loader=None, total_steps=0,
                       rollout=engine, weight_sync=None, reward=None)
    w.ranks = Ranks(rank=0, world=1, local_rank=0, device=torch.device("cpu"), train=Layout(1, 1, 1, 0, 0, 0),
                    rollout_tp=1, rollout_dp=1, rollout_dp_rank=0, rollout_tp_rank=0, rollout_group=None)
    w.sampling = train_sampling(cfg.rollout, [2])
    return w


PROMPTS3 = [[5, 17, 42], [3, 3, 9], [7, 8]]


def prompts():
    import numpy as np

    from megarl.protocol import DataProto
    return DataProto(non_tensor_batch={"prompt_token_ids": np.array(PROMPTS3, dtype=object),
                                       "uid": np.array(["a", "b", "c"], dtype=object)})


class TrainerSide:
    """The trainer's half of the bridge, played by the test: it takes every hand-off and, as a
    trainer slower than the engine, never signals an update ahead of time; an update becomes
    available when the engine blocks for it. The engine's weights stay those of version 0 (the
    sync carries no tensors here): the schedule and the version labels are what is under test."""

    def __init__(self, start):
        self.start, self.payloads = start, []

    def broadcast_object(self, payload, src):
        if payload is None:
            return self.start            # send_start
        self.payloads.append(pickle.loads(pickle.dumps(payload)))     # a copy, as the wire makes one
        return payload

    def arrived(self, version):
        return False

    def take(self, version):
        return version

    def sync(self):
        return {}


def stream_worker(engine, k, total, start, extra=(), stops=None, weight_sync=None):
    """`weight_sync`: what each update's sync() runs (default: nothing is loaded)."""
    import dataclasses
    from collections import deque

    from megarl.data.loader import PromptLoader
    from megarl.trainer.stream.worker import Period
    w = rollout_worker(engine, [f"async_training.max_staleness={k}", "trainer.test_freq=-1", "trainer.save_freq=2",
                                 *extra])
    loader = PromptLoader([{"prompt_token_ids": p, "index": i} for i, p in enumerate(PROMPTS3 * 6)], 3, seed=2)
    start = {"step": 0, "inflight": False, "loader": loader.sampler.state_dict(), **start}
    side = TrainerSide(start)
    w.ranks = dataclasses.replace(w.ranks, world_group=side, handoff_group=side, n_trainers=1)
    w.p = dataclasses.replace(w.p, train_loader=loader, weight_sync=weight_sync or side, total_steps=total)
    w.signal, w.total, w.depth, w.val, w.period, w.buffer = side, total, max(1, k), {}, Period(), deque()
    if stops is not None:
        w.sampling = w.sampling.with_(stop_token_ids=stops)
    w._run()
    return w, side.payloads
