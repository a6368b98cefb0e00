"""Activation memory saved by gradient checkpointing on CPU: one process per setting builds the same
megatron actor (8 layers, hidden 256, 8 rows of ~480 tokens in one micro-batch) and samples its
resident set size every millisecond through one forward and backward (after a warm-up step); the
peak RSS of the step, model and optimizer-free state included, is what compares across settings.

    python benchmarks/recompute_memory.py            # prints one line per setting
    python benchmarks/recompute_memory.py --smoke    # 2 layers, hidden 64, short rows: that it runs
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {"off": {}, "full_uniform_1": {"recompute_granularity": "full"},
            "selective_core_attn": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


SHAPES = {"full": dict(model=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8),
                       rows=dict(R=240, prompts=(200, 241), min_response=200)),
          "smoke": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                        rows=dict(R=24, prompts=(20, 25), min_response=20))}


def one(path: str, setting: str, shape: str) -> None:
    from megarl.parallel.local_ranks import free_port
    # a free port: --smoke runs the settings side by side
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from megarl.models.megatron_import import import_megatron
    import_megatron()
    from megarl.parallel import state
    from megarl.workers.actor import ActorWorker
    from megarl.workers.config import ActorConfig, MegatronConfig, ModelConfig, OptimConfig
    from tests.helpers.megatron_roles import TEMP, make_batch, policy_loss

    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, ppo_max_token_len_per_gpu=65536,
                      megatron=MegatronConfig(override_transformer_config=SETTINGS[setting]),
                      optim=OptimConfig(lr=1e-3))
    state.init_distributed()   # the rank set-up: the engine starts no process group
    actor = ActorWorker(ModelConfig(path=path), cfg)
    data = make_batch(301, B=8, **SHAPES[shape]["rows"])
    process = actor._process(TEMP, True, True)
    actor.engine.accumulate(data, 8, process, policy_loss)       # warm-up: allocator pools, grad buffers
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)
    watcher = threading.Thread(target=sample)
    watcher.start()
    start = time.perf_counter()
    actor.engine.accumulate(data, 8, process, policy_loss)
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    # The absolute peak compares settings: RSS before the step still holds what the allocator kept
    # from the warm-up step's activations, so the rise alone understates the setting without recompute.
    print(f"{setting}: peak resident MiB {peak[0] / 2**20:.0f} during the step (before it {before / 2**20:.0f}), "
          f"{seconds:.2f}s")


def main() -> None:
    if len(sys.argv) == 4:
        one(*sys.argv[1:])
        return
    shape = "smoke" if sys.argv[1:] == ["--smoke"] else "full"
    sys.path.insert(0, ROOT)
    from megarl.models.tiny import make_tiny_hf
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_hf(os.path.join(tmp, "m"), "qwen2", num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=1024, **SHAPES[shape]["model"])
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # One process per setting, so each peak is its own. The full run measures them one at a time;
        # --smoke only shows that each runs, so its processes run side by side.
        runs = {}
        for setting in SETTINGS:
            out, err = (open(os.path.join(tmp, f"{setting}.{k}"), "w+") for k in ("out", "err"))
            runs[setting] = (subprocess.Popen([sys.executable, __file__, path, setting, shape], env=env, stdout=out,
                                              stderr=err, text=True), out, err)
            if shape == "full":
                runs[setting][0].wait()
        for setting, (proc, out, err) in runs.items():
            proc.wait()
            out.seek(0), err.seek(0)
            lines = [line for line in out.read().splitlines() if line.startswith(setting)]
            if not lines:
                sys.exit(f"{setting}: failed\n{err.read()[-2000:]}")
            print(lines[-1])


if __name__ == "__main__":
    main()
