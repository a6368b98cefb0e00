"""MoE routing replay (R2 / R3) on real megatron-core and 4 gloo ranks, transformers as the oracle.

One spawn walks TP2 x SP x EP2 and PP2 x EP2 (both packed, DP 2), then PP2 x EP2 again with activation
recompute and right-padded micro-batches. Per layout, against transformers' Qwen3-MoE:
  * R2 recording: the routes the old-policy pass records equal transformers' own top-k in every
    layer at every real position (the tiny model's routers are clear-cut, so fp32 agrees);
  * replay: a different route set (every expert id shifted by one) replayed through the trainer
    gives transformers' log-probs and gradients when transformers is forced onto the same routes
    (its router's softmax live, as megatron's replay keeps it); router weights get gradients;
  * a forward hook on every megatron Router sees a routing map equal to the replayed top-k, and the
    experts chosen over all ranks' real tokens add up to the batch's, layer by layer;
  * with recompute, every router re-runs in backward on REPLAY_BACKWARD with its own micro-batch's
    routes (stage 0 has two micro-batches in flight; the gradient check fails if it takes another's);
  * the routes at each row's final position change no log-prob or entropy (causal attention);
  * every router's replay state is cleared after each pass; an update under R2 runs and moves the model.
In-process: the route layouts (packed, padded, SP, CP) round-trip; routes survive the checkpoint
of the async loop's in-flight batch; the config refusals.

    python -m pytest -q tests/test_routing_replay.py
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.models import routing_replay as rr
from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks
from tests.helpers.megatron_roles import TEMP, TOL, hf_policy_backward, make_batch, policy_loss

E, K, LAYERS = 4, 2, 4
# (TP, PP, EP, full activation recompute); DP 2, micro-batches of 2 rows. Under PP2 with recompute,
# stage 0 runs two forwards before the first backward, so each recomputed forward must take its own
# micro-batch's routes (RouterReplay's REPLAY_BACKWARD list), not the last ones set.
LAYOUTS = [(2, 1, 2, False), (1, 2, 2, False), (1, 2, 2, True)]
PADDED = (1, 2, 2, True)      # this one right-pads its micro-batches (model.use_remove_padding=false)
NO_AUX = {"router_aux_loss_coef": 0.0}


# -- transformers as the engine: natural routes, or forced onto given ones ------------------------------------
def _route_gates(model, forced: torch.Tensor | None, seen: list):
    """Patch every layer's router: record its top-k, or (forced [B, S, L, K]) take those experts with
    the probabilities of transformers' live softmax (renormalised over the top-k when the config says)."""
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate

        def forward(hidden, gate=gate, layer=layer):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = logits.softmax(-1, dtype=torch.float)
            idx = probs.topk(gate.top_k, dim=-1).indices if forced is None else \
                forced[:, :, layer].reshape(-1, gate.top_k).long()
            seen.append(idx)
            val = probs.gather(1, idx)
            if gate.norm_topk_prob:
                val = val / val.sum(-1, keepdim=True)
            return logits, val.to(logits.dtype), idx
        gate.forward = forward


def hf_reference(path: str, data, forced: torch.Tensor | None = None) -> dict:
    """transformers' log-probs, gradients and routes [B, S, L, K] of `data` (forced or natural)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen: list = []
    _route_gates(model, forced, seen)
    ids = data.batch["input_ids"]
    B, S = ids.shape
    logits = model(ids).logits
    lp, _ = hf_policy_backward(logits, data)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    routes = torch.stack([s.reshape(B, S, -1) for s in seen], dim=2)
    return {"log_probs": lp.detach(), "grads": _per_expert(grads), "routes": routes}


def _per_expert(grads: dict) -> dict:
    """transformers 5 fuses experts ([E, ...] gate_up_proj / down_proj); megarl exports per expert."""
    out = {}
    for name, g in grads.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(g):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            out.update({f"{base}{e}.down_proj.weight": w for e, w in enumerate(g)})
        else:
            out[name] = g
    return out


def real_positions(data) -> torch.Tensor:
    lens = data.batch["prompt_lens"] + data.batch["response_lens"]
    return torch.arange(data.batch["input_ids"].shape[1])[None] < lens[:, None]     # [B, S]


def batch_routes(routes: torch.Tensor, data) -> torch.Tensor:
    """The interface's form: route_dtype, padding positions 0."""
    out = routes.to(rr.route_dtype(E)).clone()
    out[~real_positions(data)] = 0
    return out


# -- the spawn ------------------------------------------------------------------------------------------------
def _actor(path: str, tp: int, pp: int, ep: int, recompute: bool, micro: int):
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig, RouterReplayConfig
    mc = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=micro, megatron=mc, entropy_coeff=0.01,
                      optim=OptimConfig(lr=1e-3), router_replay=RouterReplayConfig(mode="R2"))
    model = ModelConfig(path=path, override_config=dict(NO_AUX), enable_gradient_checkpointing=recompute,
                        use_remove_padding=(tp, pp, ep, recompute) != PADDED)
    state.init_distributed()   # the rank set-up; the engine starts no process group
    return ActorWorker(model, cfg)


def _watch_routers(engine) -> tuple[list, dict]:
    """Forward hooks on every megatron Router of this rank: whether its routing map is the replayed
    top-k, and per layer the experts its real tokens went to (counted)."""
    from megatron.core.transformer.moe.router import Router
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megarl.parallel import state
    followed, counts, recomputed = [], {}, []

    def layer_of(router):
        return router.layer_number - 1

    def hook(router, args, kwargs, output):
        _, routing_map = output
        replay = router.router_replay
        if replay.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
            recomputed.append(layer_of(router))   # its routes came off the backward list (the grads check them)
            return
        target = replay.target_topk_idx
        if target is None:
            return
        want = torch.zeros_like(routing_map).scatter(1, target.to(routing_map.device), True)
        followed.append(bool(torch.equal(routing_map, want)))
        pad = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)   # [s, b], True at padding
        if pad is not None and pad.numel() != routing_map.shape[0]:     # full length; the router sees its SP chunk
            lay = state.layout()
            pad = pad.chunk(lay.tp, dim=0)[lay.tp_rank]
        real = torch.ones(routing_map.shape[0], dtype=torch.bool) if pad is None else ~pad.reshape(-1).cpu()
        layer = layer_of(router)
        counts[layer] = counts.get(layer, 0) + routing_map[real].sum(0).long().cpu()

    handles = [m.register_forward_hook(hook, with_kwargs=True)
               for c in engine.models for m in c.modules() if isinstance(m, Router)]
    return handles, {"followed": followed, "counts": counts, "recomputed": recomputed}


def _cpu_recompute() -> None:
    """megatron's activation recompute saves and restores the CUDA RNG state around each layer,
    which a CPU-only torch lacks, and megarl's CPU mapping (cpu_compat) does not cover it (no
    megarl run recomputes on CPU). The tiny model has no dropout, so the CPU RNG is the only state
    the recompute needs; megatron's CheckpointFunction itself runs unchanged."""
    from megatron.core.tensor_parallel import random as mrandom

    from megarl.parallel import cpu_compat
    mrandom._get_all_rng_states = lambda: (torch.get_rng_state(), None, {})
    mrandom._set_all_rng_states = lambda cpu, cuda, tracker: torch.set_rng_state(cpu)
    # the recomputed forward runs inside autograd, outside the engine's CPU mapping: map it there too
    fn = mrandom.CheckpointFunction
    fn.backward = cpu_compat._in_mode(vars(fn)["backward"])


def check_layouts(rank, world, path: str, forced: torch.Tensor):
    from megarl.parallel import state
    if not torch.cuda.is_available():
        _cpu_recompute()
    out = {}
    for tp, pp, ep, recompute in LAYOUTS:
        data = make_batch(301)
        micro = 2
        actor = _actor(path, tp, pp, ep, recompute, micro)
        eng, r = actor.engine, {"packed": actor.engine.packed}
        # R2's old-policy pass records
        lp, _, recorded = actor.compute_log_prob(data, TEMP, record_routes=True)
        r["recorded"], r["lp_natural"] = recorded, lp
        # a different route set, replayed forward and backward
        data.batch[rr.KEY] = forced
        handles, seen = _watch_routers(eng)
        r["lp_forced"] = eng.forward_rows(data, micro, actor._process(TEMP, True), ("log_probs",),
                                          routes="replay")["log_probs"]
        for c in eng.chunks:
            c.train()                      # as an update runs it: megatron recomputes only in training mode
        eng.accumulate(data, micro, actor._process(TEMP, True, True), policy_loss, routes="replay")
        r["grads"] = dict(eng.hf_grads())
        for h in handles:
            h.remove()
        r["followed"], r["counts"], r["recomputed"] = seen["followed"], seen["counts"], seen["recomputed"]
        # nothing left behind: every router's action and indices are cleared
        from megarl.workers.routes import routers
        r["clean"] = all(x.router_replay_action is None and x.target_topk_idx is None and not x.replay_backward_list
                         for c in eng.models for _, x in routers(c))
        if (tp, pp, ep) == (2, 1, 2):
            # the final real position's routes change no log-prob or entropy (attention is causal)
            last = data.batch["prompt_lens"] + data.batch["response_lens"] - 1
            moved = forced.clone()
            moved[torch.arange(len(last)), last] = (moved[torch.arange(len(last)), last] + 1) % E
            data.batch[rr.KEY] = moved
            rows = eng.forward_rows(data, micro, actor._process(TEMP, True), ("log_probs", "entropy"),
                                    routes="replay")
            data.batch[rr.KEY] = forced
            again = eng.forward_rows(data, micro, actor._process(TEMP, True), ("log_probs", "entropy"),
                                     routes="replay")
            r["last_position"] = max((rows[k] - again[k]).abs().max().item() for k in rows)
        # the update under R2 replays the recorded routes
        data.batch[rr.KEY] = recorded
        r["metrics"] = actor.update_policy(data, policy_loss, TEMP)
        r["moved"] = (actor.compute_log_prob(data, TEMP)[0] - lp).abs().max().item()
        out[(tp, pp, ep, recompute)] = r
        del actor, eng
        state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("replay") / "m"), "qwen3_moe", seed=11, vocab_size=301)


@pytest.mark.timeout(900)
def test_replay_follows_routes_under_tp_sp_ep_and_pp_ep(moe_model):
    data = make_batch(301)
    natural = hf_reference(moe_model, data)
    forced = batch_routes((natural["routes"] + 1) % E, data)
    ref = hf_reference(moe_model, make_batch(301), forced)
    real = real_positions(data)
    assert (ref["log_probs"] - natural["log_probs"]).abs().max() > 1e-2      # the forced routes matter
    ranks = run_ranks(4, check_layouts, (moe_model, forced))
    for key, r in ranks[0].items():
        # R2's record is transformers' own top-k at every real position, in every layer
        got, want = r["recorded"], natural["routes"]
        assert got.dtype == torch.uint8 and got.shape == want.shape, key
        assert torch.equal(got[real].long().sort(-1).values, want[real].long().sort(-1).values), key
        assert (got[~real] == 0).all(), key
        assert (r["lp_natural"] - natural["log_probs"]).abs().max() < TOL, key
        # replayed: transformers on the same routes, log-probs and gradients (router weights included)
        assert (r["lp_forced"] - ref["log_probs"]).abs().max() < TOL, key
        grads = {n: g for rk in ranks for n, g in rk[key]["grads"].items()}
        assert sorted(grads) == sorted(ref["grads"]), key
        assert max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads) < 1e-5, key
        gate = [n for n in grads if n.endswith("mlp.gate.weight")]
        assert len(gate) == LAYERS and all(grads[n].abs().max() > 1e-6 for n in gate), key
        # every router on every rank followed the replay, and the real tokens' experts add up
        assert all(all(rk[key]["followed"]) and rk[key]["followed"] for rk in ranks), key
        for layer in range(LAYERS):
            total = sum(rk[key]["counts"].get(layer, 0) for rk in ranks)
            want_counts = torch.bincount(forced[real][:, layer].long().flatten(), minlength=E)
            # forward_rows and accumulate each ran the batch once
            assert torch.equal(total, 2 * want_counts), (key, layer)
        assert all(rk[key]["clean"] for rk in ranks), key
        # with recompute, every router re-ran once per micro-batch in backward, on REPLAY_BACKWARD
        recomputed = sorted(x for rk in ranks for x in rk[key]["recomputed"])
        assert recomputed == (sorted(list(range(LAYERS)) * 4) if key[3] else []), key
        assert r["moved"] > 1e-3 and r["metrics"]["actor/grad_norm"] > 0, key
    assert ranks[0][(2, 1, 2, False)]["last_position"] == 0.0
    assert [r["packed"] for r in ranks[0].values()] == [True, True, False]


# -- in-process ---------------------------------------------------------------------------------------------
def test_route_layouts_round_trip():
    from megarl.models.context_parallel import split_sequence
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 3, 7])
    routes = torch.randint(0, 60, (3, 8, 3, 2), generator=g).to(torch.uint8)
    real = torch.arange(8)[None] < lens[:, None]
    routes[~real] = 0
    for packed, cols in ((True, 16), (False, 8), (False, 10)):
        micro = rr.micro_routes(routes, lens, packed, cols)
        assert micro.shape == ((1, cols) if packed else (3, cols)) + (3, 2)
        if packed:   # rows back to back, like packing.packed_input's ids
            assert torch.equal(micro[0, 5:8], routes[1, :3]) and torch.equal(micro[0, 15], torch.arange(2).byte()[None]
                                                                                .expand(3, 2))
        assert torch.equal(rr.unpack_rows(micro, lens, packed, 8), routes)
        for sp in (1, 2):
            for cp in (1, 2):
                if cols % (2 * cp * sp):
                    continue
                local = split_sequence(micro, 1 % cp, cp, dim=1)
                buf = torch.zeros_like(local)
                for rank in range(sp):
                    for layer in range(3):
                        tokens = rr.local_tokens(local, layer, rank, sp)
                        assert tokens.dtype == torch.int64 and \
                            tokens.shape == (local.shape[1] // sp * local.shape[0], 2)
                        rr.place_tokens(tokens, buf, layer, rank, sp)
                assert torch.equal(buf, local)
                full = sum(rr.place_sequence(split_sequence(micro, r, cp, dim=1), r, cp, dim=1) for r in range(cp))
                assert torch.equal(full, micro)
    assert rr.route_dtype(256) == torch.uint8 and rr.route_dtype(257) == torch.int16
    assert rr.bytes_per_token(48, 8, 128) == 48 * 8 and rr.bytes_per_token(2, 8, 512) == 32
    with pytest.raises(ValueError, match="expert 9"):
        rr.check_routes(torch.full((2, 4, 1, 1), 9), torch.zeros(2, 4), 1, 1, 4)
    with pytest.raises(ValueError, match="shape"):
        rr.check_routes(torch.zeros(2, 3, 1, 1), torch.zeros(2, 4), 1, 1, 4)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.router_replay.mode=R3"], "enable_rollout_routing_replay=true"),
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"], "nothing replays"),
    (["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
      "actor_rollout_ref.rollout.name=hf"], "for R3|R3 needs"),
    (["actor_rollout_ref.ref.router_replay.mode=R2"], "frozen|old-policy"),
    (["actor_rollout_ref.ref.router_replay.mode=R3"], "only under the actor's R3"),
    (["actor_rollout_ref.actor.router_replay.record_file=/tmp/x"], "never through files"),
    (["actor_rollout_ref.actor.router_replay.mode=R4"], "R4"),
])
def test_config_refusals(overrides, message):
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_dense_model_refused(tmp_path):
    import json
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    dense = make_tiny_hf(str(tmp_path / "dense"), "qwen3", tokenizer=False)
    moe = make_tiny_hf(str(tmp_path / "moe"), "qwen3_moe", tokenizer=False)
    keys = ["actor_rollout_ref.actor.router_replay.mode=R2"]
    cfg = load_config(None, keys + [f"actor_rollout_ref.model.path={dense}"])
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM is dense"):
        cfg.check_model(json.load(open(f"{dense}/config.json")))
    load_config(None, keys + [f"actor_rollout_ref.model.path={moe}"]).check_model(json.load(open(f"{moe}/config.json")))


def test_routes_survive_checkpoint_of_the_inflight_batch(tmp_path):
    """The async trainer saves its in-flight batch in trainer_state.pt (AsyncRLTrainer.state_dict); its
    routes come back bit for bit, in their own dtype, through the real save / verify / load path."""
    from megarl.trainer.checkpoints import checkpointing
    batch = make_batch(301)
    g = torch.Generator().manual_seed(3)
    for num_experts, dtype in ((4, torch.uint8), (300, torch.int16)):
        routes = torch.randint(0, num_experts, (*batch.batch["input_ids"].shape, LAYERS, K), generator=g)
        batch.batch[rr.KEY] = batch_routes(routes, batch).to(dtype)
        root = str(tmp_path / str(num_experts))
        checkpointing.save(root, 2, {}, {"step": 2, "inflight_batch": batch}, rank=0, keep=None)
        state = checkpointing.load(checkpointing.latest_step_dir(root), {}, rank=0, world=1)
        back = state["inflight_batch"].batch[rr.KEY]
        assert back.dtype == dtype and torch.equal(back, batch.batch[rr.KEY])
        assert torch.equal(state["inflight_batch"].batch["input_ids"], batch.batch["input_ids"])
