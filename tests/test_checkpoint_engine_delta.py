"""Delta weight sync (megarl/checkpoint_engine/delta.py, delta_sync.py).

Pure: every encoding round-trips; a changed element's place in the engine's part, computed by
index arithmetic, is where the real conversion (split_shard + narrow_to on an arange) puts it.
On 4 real gloo ranks (one spawn): trainer TP 2 -> two engines at rollout TP 1, and trainer PP 2
-> one engine at rollout TP 2, bf16 engines, 13 syncs each: after every one the engine's bits
equal the trainer's weights cast to bf16 (what a full sync gives); anchors come first, every K,
after a failure, after a resume and after an engine restart; a corrupted frame fails the sync on
every rank through the checksum, the engine undoes the delta, and the next sync is full; a
change of every element goes dense."""
from __future__ import annotations

import sys

import pytest
import torch

from megarl.checkpoint_engine import delta as D
from megarl.models.tiny import make_tiny_hf
from tests.distributed import run_ranks

TRAINERS, ENGINES = [0, 1], [2, 3]
BF16 = torch.bfloat16


# -- pure ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec, module", [("zstd", "zstandard"), ("lz4", "lz4")])
def test_a_missing_codec_package_is_one_line_where_the_sync_is_built(codec, module, monkeypatch):
    """Without the codec's package (sys.modules[name] = None is how Python blocks an import), the
    config and every direct builder of delta options (the benchmarks) stop with one line naming
    the package, before any rank syncs."""
    from megarl.checkpoint_engine.delta_sync import DeltaOptions
    from megarl.config import ConfigError
    from megarl.experiment import load_config
    DeltaOptions(codec=codec)                                  # installed: the test extras take megarl[compress]
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ValueError) as built:
        DeltaOptions(codec=codec)
    with pytest.raises(ConfigError) as configured:
        ce = "actor_rollout_ref.rollout.checkpoint_engine"
        load_config(None, [f"{ce}.backend=disk", f"{ce}.disk_dir=/tmp/w", f"{ce}.delta_compression={codec}"])
    for err in (built.value, configured.value):
        assert f"pip install {module}" in str(err) and "delta_compression=none" in str(err) and "\n" not in str(err)
    assert configured.value.key == "actor_rollout_ref.rollout.checkpoint_engine.delta_compression"
    with pytest.raises(ValueError, match="unknown delta compression 'gzip'"):
        DeltaOptions(codec="gzip")


@pytest.mark.parametrize("codec", ["none", "zstd", "lz4"])
def test_encodings_round_trip(codec):
    g = torch.Generator().manual_seed(0)
    last = torch.randn(5000, generator=g).to(BF16)
    for frac, kinds, scale in ((0.0, {D.STEPS, D.GAPS}, 4.0), (0.02, {D.GAPS, D.XOR}, 4.0), (0.02, {D.STEPS}, 1.01),
                               (0.9, {D.DENSE}, 4.0)):
        new = last.clone()
        pick = torch.rand(5000, generator=g) < frac
        new[pick] = (new[pick].float() * scale + 1e-3 * (scale - 1)).to(BF16)
        f = D.encode(new, last, dense_above=0.25, codec=codec)
        assert f.kind in kinds and f.nnz == int((D.bits(new) != D.bits(last)).sum())
        idx, vals = D.decode(f.kind, f.codec, f.payload, new.numel(), f.nnz, BF16)
        out = last.clone()
        if idx is None:
            out = vals.clone()
        else:
            out[idx] = D.updated(f.kind, last[idx], vals, BF16)
        assert torch.equal(D.bits(out), D.bits(new))
        if frac == 0.02:
            assert f.payload.numel() < 0.25 * new.numel() * 2      # well under the dense frame
        if f.kind == D.STEPS and f.codec == "none" and scale < 2:
            assert f.payload.numel() == 3 * f.nnz                   # 2 bytes a position, 1 a step
    assert D.encode(last, None, 0.25).kind == D.DENSE               # no copy yet: dense
    far = torch.zeros(200_000, dtype=BF16)                           # a gap past 16 bits: int32 indices
    moved = far.clone()
    moved[[3, 150_000]] = 1.0
    f = D.encode(moved, far, 0.25)
    idx, vals = D.decode(f.kind, f.codec, f.payload, far.numel(), f.nnz, BF16)
    assert f.kind == D.INDICES and idx.tolist() == [3, 150_000] and vals.tolist() == [1.0, 1.0]


def test_checksum_catches_one_flipped_bit_anywhere():
    t = torch.randn(1001).to(BF16)                                  # 2002 bytes: a partial last word
    ref = D.checksum(t)
    for i in (0, 500, 1000):
        u = t.clone()
        D.bits(u)[i] ^= 1 << 3
        assert D.checksum(u) != ref


def test_piece_index_map_matches_the_real_conversion(tmp_path):
    """For every tensor kind (fused QKV with GQA, fc1's gate/up, row- and column-parallel, padded
    vocabulary, replicated norms), trainer TP 2 -> rollout TP 1, 2 and 4: to_part puts each
    element where split_shard + narrow_to (the full sync's own conversion) put it."""
    from megarl.checkpoint_engine.plan import build_plan, split_shard
    from megarl.models.convert import hf_to_megatron
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.rollout.native.tp import ShardPlan
    from megarl.rollout.native.model import ModelArgs
    from megarl.models.hf_config import read_hf_config
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", seed=1, vocab_size=301, tokenizer=False)
    spec = HFCheckpoint(path).spec()
    tp = 2
    plan = build_plan(spec, tp, 1, 1 << 30, 2, (), "lm", gather_all=True)
    full = plan.hf_shapes()
    args = ModelArgs.from_hf(read_hf_config(path))
    # every element's identity: its flat index in the full HF tensor
    ids = {h: torch.arange(int(torch.tensor(s).prod())).view(s) for h, s in full.items()}
    cut = {(e.name, t): hf_to_megatron(e.name, ids, spec, t, tp) for b in plan.buckets for e in b.entries
           for t in range(tp)}
    for rtp in (1, 2, 4):
        if spec.num_kv_heads % rtp and rtp % spec.num_kv_heads:
            continue
        for r in range(rtp):
            eplan = ShardPlan(args, r, rtp)
            for b in plan.buckets:
                for t in range(tp):
                    for e in b.entries:
                        shard = cut[(e.name, t)]
                        pieces = [p for p in D.bucket_pieces(plan, b, t) if p.part.hf_name in
                                  {s.hf_name for s, _ in split_shard(e.name, shard, spec, t, tp)}]
                        for (s, tensor), p in zip([x for x in split_shard(e.name, shard, spec, t, tp)
                                                   if not (x[0].dim is None and t)], pieces):
                            target = eplan.target(s.hf_name)
                            if target is None:
                                continue
                            want = target[2]
                            engine_part = want.take(ids[s.hf_name]).reshape(-1)
                            idx = torch.arange(p.numel)
                            keep, flat = D.to_part(p, idx, full[s.hf_name], want)
                            got = engine_part[flat]
                            assert torch.equal(got, tensor.reshape(-1)[keep]), (s.hf_name, t, r, rtp)
                            # and every element of the engine part inside the piece is reached
                            assert keep.sum() == narrow_to_count(p, full[s.hf_name], want)


def narrow_to_count(p, shape, want) -> int:
    ranges = D._ranges(p, shape, want)
    return 0 if ranges is None else int(torch.tensor([b - a for a, b in ranges]).prod())


def test_delta_config_keys():
    from megarl.config.errors import ConfigError
    from megarl.experiment import load_config
    base = ["actor_rollout_ref.model.path=/nonexistent", "trainer.n_gpus_per_node=4"]
    with pytest.raises(ConfigError, match="delta.*distributed or disk transport"):
        load_config(None, base + ["actor_rollout_ref.rollout.checkpoint_engine.delta=on"])
    cfg = load_config(None, base + ["actor_rollout_ref.rollout.checkpoint_engine.delta=auto"])
    assert cfg.rollout.checkpoint_engine.delta == "auto"
    with pytest.raises(ConfigError, match="delta_anchor_every"):
        load_config(None, base + ["actor_rollout_ref.rollout.checkpoint_engine.delta_anchor_every=0"])


def test_delta_auto_resolution(caplog):
    from megarl.checkpoint_engine.delta_sync import delta_options
    from megarl.rollout.config import CheckpointEngineConfig
    auto = CheckpointEngineConfig(delta="auto")
    with caplog.at_level("INFO"):
        assert delta_options(auto, BF16, "colocated") is None
        assert delta_options(auto, torch.float32, "distributed") is None
    assert "resolves to off" in caplog.text and "colocated" in caplog.text
    assert delta_options(auto, BF16, "distributed").anchor_every == 20
    verl = CheckpointEngineConfig(backend="delta_sharded")           # verl's spelling
    assert (verl.backend, verl.delta) == ("distributed", "on")


# -- 4 gloo ranks ------------------------------------------------------------------------------------------
def nudge(weights: dict, step: int, frac: float = 0.03) -> None:
    """A few elements move by 5% (their bf16 bits change), every element by 1e-7 relative (its
    fp32 bits change, its bf16 bits almost never)."""
    for n, w in weights.items():
        g = torch.Generator().manual_seed(1000 * step + len(n))
        pick = torch.rand(w.shape, generator=g) < frac
        w.mul_(1 + 1e-7)
        w[pick] *= 1.05


def bits_equal(engine, expected: dict) -> bool:
    for name, full in expected.items():
        for dst, rows, src in engine.plan.route(name, full.to(BF16)):
            if not torch.equal(engine.params[dst].data[rows].view(torch.int16), src.view(torch.int16)):
                return False
    return True


def check_delta(rank, world, path):
    import torch.distributed as dist

    from megarl.checkpoint_engine import WeightSyncError
    from megarl.checkpoint_engine.delta_sync import DeltaOptions
    from megarl.checkpoint_engine.distributed import DisaggregatedGroups, DisaggregatedReceiver, DisaggregatedSender
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.models.hf_checkpoint import HFCheckpoint
    from megarl.models.hf_config import read_hf_config
    from megarl.parallel.bridge import Bridge, job_store
    from megarl.rollout.native import NativeEngine, TPComm
    from tests.helpers.checkpoint_engine import megatron_shards as shards_of

    store, _, _ = job_store(120)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world)
    everyone = Bridge(store, "world", range(world), rank)
    ckpt = HFCheckpoint(path)
    spec = ckpt.spec()
    opts = DeltaOptions(anchor_every=5)
    out = {}
    for tp, pp, rtp in ((2, 1, 1), (1, 2, 2)):
        trainer_rank = (lambda t, d, p: t) if tp == 2 else (lambda t, d, p: p)
        groups = DisaggregatedGroups.create(tp, pp, trainer_rank, ENGINES, store, rank, everyone, tag=f"d{tp}x{pp}")
        engine_group = dist.new_group(ENGINES) if rtp == 2 else None

        def new_engine():
            return NativeEngine(read_hf_config(path), comm=TPComm(engine_group), dtype="bfloat16")
        weights = {n: ckpt.read_full(n).float() for n in ckpt.names()}
        r = {"anchor": [], "exact": [], "changed": [], "errors": []}
        if rank in TRAINERS:
            t, p = (rank, 0) if tp == 2 else (0, rank)

            def source():
                return ShardSource(spec, tp, pp, t, p, 0, shards_of(weights, spec, tp, pp, t, p))
            side = DisaggregatedSender(source(), groups, bucket_bytes=40 << 10, dtype=BF16, delta=opts)
        else:
            engine = new_engine()
            side = DisaggregatedReceiver(engine, spec, groups, BF16, bucket_bytes=40 << 10, keep_previous=True,
                                         delta=opts)
        snapshot = None

        def sync(expect_fail=False):
            if rank in TRAINERS:
                side.src = source()
            try:
                m = side.sync()
                r["anchor"].append(m["weight_sync/anchor"])
                r["changed"].append(m["weight_sync/changed_frac"])
            except WeightSyncError as err:
                r["anchor"].append("failed")
                r["errors"].append(str(err))
            if rank in ENGINES:
                r["exact"].append(bits_equal(engine, weights))

        sync()                                              # 1: first sync, an anchor
        for step in range(2, 7):                            # 2-5 deltas, 6: every 5 -> anchor
            nudge(weights, step)
            if step == 3:
                snapshot = {n: w.clone() for n, w in weights.items()}
            sync()
        for w in weights.values():                          # 7: every element changes -> dense frames
            w.mul_(1.02)
        sync()
        before = {n: w.clone() for n, w in weights.items()}
        nudge(weights, 8)                                   # 8: a corrupted frame from trainer rank 0
        if rank == TRAINERS[0]:
            real = side.delta.frame
            hit = []

            def corrupt(bucket, params):
                head, payload = real(bucket, params)
                if not hit and payload.numel():
                    hit.append(bucket.index)
                    payload = payload.clone()
                    payload[-1] ^= 0x40                     # the high byte of the last value
                return head, payload
            side.delta.frame = corrupt
        sync()
        if rank == TRAINERS[0]:
            side.delta.frame = real
        if rank in ENGINES:                                 # undone: the previous weights, bit for bit
            r["undone"] = bits_equal(engine, before)
        sync()                                              # 9: anchor after the failure
        weights = snapshot                                  # 10: resume from step 3's checkpoint
        if rank in TRAINERS:
            side.request_anchor("resumed from a checkpoint")
        sync()
        nudge(weights, 11)                                  # 11: a delta again
        sync()
        if rank in ENGINES:                                 # 12: the engine restarts (no weights)
            engine = new_engine()
            side.replace_engine(engine)
        nudge(weights, 12)
        sync()
        nudge(weights, 13)                                  # 13: delta
        sync()
        if rank in TRAINERS:
            r["kinds"] = dict(side.delta.kinds)
            r["copy_mb"] = side.delta_copy_bytes() / 2**20
        out[(tp, pp, rtp)] = r
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("delta") / "qwen2"), "qwen2", seed=4, vocab_size=301,
                        tokenizer=False)


@pytest.mark.timeout(300)
def test_delta_sync_bit_exact_with_anchors_and_faults(small):
    ranks = run_ranks(4, check_delta, (small,))
    want = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, "failed", 1.0, 1.0, 0.0, 1.0, 0.0]
    for key in ranks[0]:
        for rank, out in enumerate(ranks):
            r = out[key]
            assert r["anchor"] == want, (key, rank, r["anchor"], r["errors"])
            if rank in ENGINES:
                assert all(r["exact"][:7] + r["exact"][8:]), (key, rank, r["exact"])
                assert r["undone"], (key, rank)
                assert "undid the delta" in r["errors"][0], r["errors"]
            else:
                assert "weight sync failed" in r["errors"][0]
                assert 0 < max(r["changed"][1:5]) < 0.1, r["changed"]        # sparse steps
                assert r["kinds"]["dense"] >= 1 and r["kinds"]["gaps"] + r["kinds"]["steps"] >= 1, r["kinds"]
                assert r["copy_mb"] > 0
        # the corrupted value lies in some engine rank's part: its checksum caught it
        assert any("checksum mismatch" in out[key]["errors"][0] for rank, out in enumerate(ranks) if rank in ENGINES)


def test_disk_delta_chain_exact_checked_and_kept(tmp_path):
    """One writer (no process group): anchor, deltas, every K a full export; read_weights gives the
    full export's bits every time; a corrupted delta file is refused; retention keeps the chain."""
    import os

    from megarl.checkpoint_engine.delta_sync import DeltaOptions
    from megarl.checkpoint_engine.disk import DiskSync
    from megarl.checkpoint_engine.disk_delta import base_of, read_weights
    from megarl.checkpoint_engine.source import ShardSource
    from megarl.models.hf_checkpoint import HFCheckpoint
    from tests.helpers.checkpoint_engine import megatron_shards as shards_of
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2", seed=2, vocab_size=301, tokenizer=False)
    ckpt = HFCheckpoint(path)
    spec = ckpt.spec()
    weights = {n: ckpt.read_full(n).float() for n in ckpt.names()}

    def source():
        return ShardSource(spec, 1, 1, 0, 0, 0, shards_of(weights, spec, 1, 1, 0, 0), hf_dtype=BF16)
    sync = DiskSync(source(), str(tmp_path / "out"), 40 << 10, keep=1, delta=DeltaOptions(anchor_every=3))
    anchors = []
    for step in range(5):
        if step:
            nudge(weights, step)
        sync.src = source()
        anchors.append(sync.sync()["weight_sync/anchor"])
        got = read_weights(sync.dir)
        assert all(torch.equal(got[n].view(torch.int16), weights[n].to(BF16).view(torch.int16)) for n in weights)
    assert anchors == [1.0, 0.0, 0.0, 1.0, 0.0]
    # keep=1 still keeps step 4's anchor (step 5 applies to it); older exports are gone
    assert sorted(os.listdir(sync.dir)) == ["latest", "step_000004", "step_000005"]
    assert base_of(str(tmp_path / "out" / "step_000005")) == "step_000004"
    victim = next(f for f in os.listdir(sync.last_path) if f.startswith("delta-"))
    with open(os.path.join(sync.last_path, victim), "r+b") as f:      # flip a byte near the end (a value)
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(ValueError, match="checksum"):
        read_weights(sync.dir)
