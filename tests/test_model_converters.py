"""The model-converter hook (megarl/models/converters.py): a converter named in the model config
runs on the built, loaded chunks before DDP and the optimizer wrap them, so the optimizer never
sees what it froze; with none configured nothing changes; an unknown name is refused in one line;
a converter's hooks are what exports, weight syncs, the reference and checkpoints ask.

    python -m pytest -q tests/test_model_converters.py
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from megarl.models.converters import (Converter, ConverterHooks, ExportedParams, build_model_converters,
                                     checkpoint_mismatch, register_converter)
from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks

FREEZE = "test_freeze_embeddings"
HANDED: list[str] = []    # the classes the converter was handed, in the rank process


@register_converter(FREEZE)
def freeze_embeddings(options: dict) -> Converter:
    """Freezes the first stage's word embedding."""
    def convert(chunks: list[nn.Module]) -> None:
        for m in chunks:
            HANDED.append(type(m).__name__)
            if m.pre_process:
                m.embedding.word_embeddings.weight.requires_grad_(False)
    return convert


def check_actor(rank: int, world: int, path: str) -> dict:
    from megarl.models.convert import EMBED
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, OptimConfig, ModelConfig

    state.init_distributed()   # the rank set-up; the engine starts no process group
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-3))
    engine = ActorWorker(ModelConfig(path=path, converters=[FREEZE]), cfg).engine
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    params = dict(engine.named_global_parameters())
    return {"handed": list(HANDED), "wrapped": type(engine.chunks[0]).__name__,
            "embed_trainable": params[EMBED].requires_grad, "embed_in_optimizer": id(params[EMBED]) in in_optimizer,
            "others_in_optimizer": all(id(p) in in_optimizer for n, p in params.items() if n != EMBED)}


def test_converter_runs_before_the_optimizer_sees_parameters(tmp_path):
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", tokenizer=False, num_hidden_layers=2)
    got = run_ranks(1, check_actor, (path,))[0]
    assert got == {"handed": ["GPTModel"], "wrapped": "DistributedDataParallel", "embed_trainable": False,
                   "embed_in_optimizer": False, "others_in_optimizer": True}


def test_converters_in_config_order_and_refusals():
    order: list[str] = []
    register_converter("test_a")(lambda opts: lambda chunks: order.append(f"a{opts.get('k', '')}"))
    register_converter("test_b")(lambda opts: lambda chunks: order.append("b"))
    build_model_converters({"test_b": {}, "test_a": {"k": 1}}).convert([nn.Linear(1, 1)])
    assert order == ["b", "a1"]
    build_model_converters(None).convert([nn.Linear(1, 1)])          # none configured: a no-op
    assert build_model_converters([]).steps == ()
    with pytest.raises(ValueError, match="unknown converter\\(s\\) qlora; registered: .*test_a") as err:
        build_model_converters(["qlora"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="already registered"):
        register_converter(FREEZE)(freeze_embeddings)


class Gain(ConverterHooks):
    """Adds a trainable gain after each linear: exports fold it into the weight; the original
    model is the gain held at 1."""

    def __call__(self, chunks: list[nn.Module]) -> None:
        for m in chunks:
            m.gain = nn.Parameter(torch.full((), 3.0))
            m.register_forward_hook(lambda mod, args, out: out * mod.gain)

    def added(self, name: str) -> bool:
        return name == "gain"

    def exported(self, chunk: nn.Module) -> dict:
        return {"weight": lambda: (chunk.weight * chunk.gain).detach()}

    @contextlib.contextmanager
    def original(self, chunks):
        saved = [m.gain.detach().clone() for m in chunks]
        with torch.no_grad():
            for m in chunks:
                m.gain.fill_(1.0)
        try:
            yield
        finally:
            with torch.no_grad():
                for m, g in zip(chunks, saved):
                    m.gain.copy_(g)


register_converter("test_gain", checkpoint_label="a gain", fix="set test_gain as at the save")(lambda opts: Gain())
register_converter("test_plain")(lambda opts: lambda chunks: None)


def test_what_megarl_asks_of_a_converter_comes_from_its_hooks():
    """Exports and weight syncs read a hook's values, the reference its original model, and the
    checkpoint its options: the same calls the engine, ShardSource, the reference and
    workers/checkpoint.py make (tests/test_lora.py runs them on megatron with LoRA)."""
    torch.manual_seed(0)
    chunk = nn.Linear(3, 2, bias=False)
    x = torch.randn(4, 3)
    before = chunk(x).detach()
    conv = build_model_converters({"test_plain": {}, "test_gain": {}})
    conv.convert([chunk])
    assert torch.allclose(chunk(x), 3 * before)
    assert conv.added("gain") and not conv.added("weight")
    assert [n for n, _ in chunk.named_parameters() if not conv.added(n)] == ["weight"]
    value = conv.export_value([chunk])
    assert torch.equal(value(chunk.weight), 3 * chunk.weight.detach())
    params = ExportedParams({"weight": chunk.weight.data}, conv.exported(chunk))
    assert torch.equal(params["weight"], 3 * chunk.weight.detach())
    with conv.original([chunk]):
        assert torch.equal(chunk(x), before)
    assert torch.allclose(chunk(x), 3 * before)
    # a plain function converter has nothing to add, export or undo
    plain = build_model_converters(["test_plain"])
    assert not plain.added("gain") and plain.exported(chunk) == {}
    with plain.original([chunk]):
        assert torch.allclose(chunk(x), 3 * before)
    # checkpoints: only converters registered with a label shape one
    assert conv.options == {"test_plain": {}, "test_gain": {}}
    assert checkpoint_mismatch({"test_gain": {}}, conv.options) is None
    assert checkpoint_mismatch({}, conv.options) == ("saved with a gain None, this role has {}; "
                                                     "set test_gain as at the save")
    assert checkpoint_mismatch({"test_gain": {}}, {"test_gain": {}, "test_plain": {"k": 1}}) is None
