"""The first command for a TensorRT-LLM user: megarl's TensorRT-LLM path on this node, one report.

    python benchmarks/trtllm_check.py --model <HF checkpoint dir> [--tp N] [--out trtllm_check_report]

Run it first with a small dense model (Qwen2.5-0.5B-Instruct or 1.5B: minutes, one GPU), then with
the size you train; the report lists which sizes fit this node's GPUs at each TP.

Nothing in megarl has executed against real TensorRT-LLM before this command; send the report
(trtllm_check.md and trtllm_check.json under --out) back with an issue.

For TP 1, and TP 2 where two GPUs exist (or the --tp given), on spawned ranks of one node:
  1. build the policy from the checkpoint as megatron holds it, frozen (no optimizer state: the
     check needs its weights and log-probs only), and the TensorRT-LLM engine (load_format=dummy,
     sleep mode on), then sync the weights into the engine (the first refit);
  2. generate with log-probs (prompts sharing a prefix of more than two KV blocks, so block reuse
     serves it); score the same tokens with megatron; count the responses that end on the
     model's EOS (its config.json and generation_config.json ids); with a MoE checkpoint, the
     engine returns its routed experts (R3), megatron replays them for its log-probs, and the
     routes are compared with those megatron's own router picks on the same tokens, per layer
     (benchmarks/trtllm_check_routes.py: the check fails under R3_MIN in any layer);
  3. generate again with the same seed: does this build repeat a seed (TorchSampler honours
     per-request seeds only from PR #17172 on), and do two equal prompts of one call differ;
  4. sleep tag by tag, recording the GPU memory each memory tag frees and what stays in use;
     refit while asleep (what a training step does); wake;
  5. generate again with the same seed; compare tokens with step 2 (only where seeds repeat) and
     log-probs with megatron's.
Every phase is timed on every rank (rank 0's figures are reported, with the slowest rank's). The
report also names the torch found here and the torch the tensorrt-llm wheel asks for.
Where tensorrt_llm does not import, or there is no CUDA device, it says so in one line and exits 2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# A shared prefix of 80 tokens: more than two blocks of KvCacheConfig.tokens_per_block (32), so
# every prompt after the first is served partly from the prefix cache.
PREFIX = list(range(100, 180))
PROMPTS = [PREFIX + p for p in ([5, 17, 42, 8, 9], [55, 12], [11, 12, 13, 14, 15, 16, 17, 18], [200, 3, 4])]
SIZES_B = (0.5, 1.5, 3, 7, 14, 32, 72)   # dense model sizes, billions of parameters


def sizes_that_fit(total_bytes: int, tp: int, utilization: float) -> dict[str, bool]:
    """Which dense bf16 models the check fits at `tp` on GPUs of `total_bytes`: the frozen policy
    and the engine's weights (2 bytes a parameter each, split over tp), plus 4 GiB of KV cache and
    buffers, within gpu_memory_utilization of the GPU (the engine's share, its weights included,
    with the policy's weights already in use when it starts)."""
    return {f"{b}B": 4 * b * 1e9 / tp + 4 * 2**30 <= utilization * total_bytes for b in SIZES_B}


def model_eos(model: str) -> list[int]:
    """The EOS ids of the checkpoint: config.json's and generation_config.json's."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        try:
            with open(os.path.join(model, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return sorted({int(i) for i in ids})
TOL = 5e-2                      # bf16 engine against a bf16 trainer: a mismatch far above this is a bug


def torch_pin(requires: list[str] | None) -> str | None:
    """The torch requirement among a distribution's requirements ("torch==2.9.0", ...), or None."""
    from packaging.requirements import Requirement
    for line in requires or []:
        req = Requirement(line)
        if req.name.lower() == "torch" and not (req.marker and "extra" in str(req.marker)):
            return str(req.specifier) or None
    return None


def torch_versions() -> dict:
    """The torch installed here against the one the installed tensorrt-llm wheel asks for, read
    from the wheel's metadata (works where tensorrt_llm itself fails to import)."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    try:
        found = md.version("torch")
    except md.PackageNotFoundError:
        found = None
    wanted = None
    for dist in ("tensorrt-llm", "tensorrt_llm"):
        try:
            wanted = torch_pin(md.requires(dist))
            break
        except md.PackageNotFoundError:
            continue
    matches = None
    if found and wanted:
        # "2.9.0+cu128" satisfies "==2.9.0": compare the public version, and allow pre-releases.
        matches = SpecifierSet(wanted).contains(Version(found).public, prereleases=True)
    return {"torch_found": found, "torch_wanted": wanted, "torch_matches": matches}


def preflight() -> str | None:
    """One line saying why this node cannot run the check, or None. Cheap: no megarl import."""
    try:
        import tensorrt_llm  # noqa: F401
    except Exception as err:
        tv = torch_versions()
        mismatch = (f"; torch {tv['torch_found']} is installed but the tensorrt-llm wheel wants torch"
                    f"{tv['torch_wanted']} (docs/trtllm.md, Install)" if tv["torch_matches"] is False else "")
        return (f"tensorrt_llm does not import here ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}){mismatch}: "
                "install it on a CUDA node from NVIDIA's index (pip install 'megarl[trtllm]' "
                "--extra-index-url https://pypi.nvidia.com) and run this again")
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device is visible: run benchmarks/trtllm_check.py on a GPU node"
    return None


def _rank(rank: int, world: int, port: int, model: str, out: str, args: dict) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    result: dict = {"rank": rank, "phases": {}}
    try:
        _phases(rank, world, model, args, result)
        result["ok"] = True
    except BaseException:
        result.update(ok=False, error=traceback.format_exc())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _phases(rank: int, world: int, model: str, args: dict, result: dict, device: str = "cuda") -> None:
    """The procedure on one rank. device="cpu" exists for the CPU test against the conformance fake
    (tests/rollout/test_trtllm_pure.py); on a GPU node it is always cuda."""
    import torch

    from megarl.parallel import state
    from megarl.protocol import DataProto
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.hf_weights import buckets
    from megarl.rollout.trtllm import TRTLLMEngine
    from benchmarks.trtllm_check_routes import megatron_routes, route_agreement
    from megarl.models.hf_config import read_hf_config
    from megarl.models.spec import ModelSpec
    from megarl.workers.config import MegatronConfig, ModelConfig, RefConfig, RouterReplayConfig
    from megarl.workers.reference import ReferenceWorker

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    phases = result["phases"]

    def timed(name, fn):
        sync()
        start = time.perf_counter()
        value = fn()
        sync()
        phases[name] = round(time.perf_counter() - start, 4)
        return value

    state.init_distributed()   # the rank set-up: the engine starts no process group
    # A MoE checkpoint runs as R3 trains: the engine records routes and megatron replays them.
    moe = ModelSpec.from_hf_config(read_hf_config(model)).is_moe
    # Frozen: megatron's weights and log-probs without an optimizer's state (the check trains nothing).
    policy = timed("build_policy", lambda: ReferenceWorker(ModelConfig(path=model), RefConfig(
        megatron=MegatronConfig(tensor_model_parallel_size=world),
        router_replay=RouterReplayConfig(mode="R3" if moe else "disabled")), micro_batch_size=4))
    cfg = RolloutConfig(name="trtllm", tensor_model_parallel_size=world, load_format="dummy", enable_sleep_mode=True,
                        free_cache_engine=True, prompt_length=128, response_length=args["max_tokens"],
                        gpu_memory_utilization=args["gpu_memory_utilization"], enable_rollout_routing_replay=moe)
    engine = timed("build_engine", lambda: TRTLLMEngine(model, cfg, tp_group=state.tp_group(),
                                                        device=torch.device("cuda", rank) if cuda else "cpu"))
    result["features"] = engine.features.summary()
    result["workers"] = engine.llm._collective_rpc("report_device_id") if engine.leader else None

    def refit():
        for bucket in buckets(policy.engine.hf_tensors(), bucket_bytes=256 << 20):
            engine.update_weights(bucket)
        engine.finalize_weights()

    sp = SamplingParams(n=2, max_tokens=args["max_tokens"], temperature=1.0, seed=7)

    def generate_and_score(tag):
        batch = timed(f"generate_{tag}", lambda: engine.generate_sequences(DataProto(
            non_tensor_batch={"prompt_token_ids": PROMPTS}, meta_info={"sampling": sp})))
        log_probs = timed(f"megatron_log_prob_{tag}", lambda: policy.compute_ref_log_prob(batch, temperature=1.0))
        mask = batch.batch["response_mask"].bool()
        diff = (log_probs.float().cpu() - batch.batch["rollout_log_probs"].float())[mask].abs()
        result[f"logprob_max_abs_diff_{tag}"] = diff.max().item()
        result[f"logprob_mean_abs_diff_{tag}"] = diff.mean().item()
        if moe and tag == "before_sleep":
            routes, own = timed("megatron_routes", lambda: megatron_routes(policy, batch))
            result["r3"] = route_agreement(batch, routes)
            result["r3"]["logprob_max_abs_diff_own_routes"] = \
                (own.float().cpu() - batch.batch["rollout_log_probs"].float())[mask].abs().max().item()
        return batch.batch["responses"].tolist()

    timed("refit_first", refit)
    before = generate_and_score("before_sleep")
    repeat = engine.generate(PROMPTS, sp)
    result["seed_repeats"] = [[c.token_ids for c in g] for g in repeat] == \
        [[c.token_ids for c in g] for g in engine.generate(PROMPTS, sp)]
    twins = engine.generate([PROMPTS[0], PROMPTS[0]], sp.with_(n=1))
    result["equal_prompts_differ"] = twins[0][0].token_ids != twins[1][0].token_ids
    eos = model_eos(model)
    ended = [c.finish_reason == "stop" for g in engine.generate(PROMPTS, sp.with_(eos_token_ids=eos)) for c in g]
    result["eos_ids"], result["eos_stop_rate"] = eos, sum(ended) / len(ended)

    # GPU memory in use on this rank's device, whoever holds it (the workers are other processes);
    # on CPU, the conformance fake's byte ledger (the leader's LLM only).
    if cuda:
        def used():
            free, total = torch.cuda.mem_get_info(rank)
            return total - free
    else:
        def used():
            return getattr(engine.llm, "resident", 0)
    freed, last = {}, [used()]

    def on_release(tag):
        now = used()
        freed[tag] = round((last[0] - now) / 2**30, 6)
        last[0] = now
    awake = used()
    timed("sleep", lambda: engine.sleep(on_release=on_release))
    result["gpu_freed_gb_per_tag"] = freed
    result["gpu_used_gb_awake"], result["gpu_used_gb_asleep"] = round(awake / 2**30, 6), round(used() / 2**30, 6)
    timed("refit_asleep", refit)
    timed("wake", engine.wake)
    after = generate_and_score("after_wake")
    result["same_tokens_after_wake"] = before == after
    result["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
    if cuda:
        result["sizes_that_fit"] = sizes_that_fit(torch.cuda.mem_get_info(rank)[1], world,
                                                  args["gpu_memory_utilization"])
    engine.close()
    state.destroy_model_parallel()


def run_tp(tp: int, model: str, args: dict) -> dict:
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank, args=(tp, port, model, out, args), nprocs=tp, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join(timeout=args["timeout"]):
                pass
        except Exception as err:
            failure = str(err)
        else:
            failure = None
        ranks = []
        for r in range(tp):
            path = os.path.join(out, f"rank{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else {"rank": r, "ok": False,
                                                                              "error": failure or "no result"})
    return {"tp": tp, "ok": all(r.get("ok") for r in ranks), "ranks": ranks}


def versions() -> dict:
    import importlib.metadata as md

    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), **torch_versions()}
    for dist in ("tensorrt-llm", "tensorrt_llm", "megatron-core", "transformers", "ray"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def markdown(report: dict) -> str:
    from benchmarks.trtllm_check_routes import markdown as routes_markdown
    lines = [f"# megarl TensorRT-LLM check ({report['date']})", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["versions"].items()]
    for run in report["runs"]:
        lead = run["ranks"][0]
        lines += ["", f"## TP {run['tp']}: {'passed' if run['ok'] and run.get('verdict') else 'FAILED'}", ""]
        if not lead.get("ok"):
            lines += ["```", str(lead.get("error", ""))[-4000:], "```"]
            continue
        repeats = lead.get("seed_repeats")
        lines += [f"- {lead.get('features')}", f"- workers on {lead.get('workers')}",
                  f"- the same seed repeats a call: {repeats}"
                  + ("" if repeats else " (this TensorRT-LLM ignores SamplingParams.seed: before PR #17172)"),
                  f"- two equal prompts of one call get different samples: {lead.get('equal_prompts_differ')}",
                  f"- same tokens after sleep/refit/wake: {lead.get('same_tokens_after_wake')}"
                  + ("" if repeats else " (not a verdict: seeds do not repeat here)"),
                  f"- GPU memory in use (rank 0's device): {lead.get('gpu_used_gb_awake')} GB awake, "
                  f"{lead.get('gpu_used_gb_asleep')} GB asleep",
                  f"- peak GPU memory (rank 0): {lead.get('peak_gpu_gb')} GB",
                  f"- responses ending on the model's EOS {lead.get('eos_ids')}: {lead.get('eos_stop_rate')}",
                  f"- dense bf16 sizes that fit at this TP: "
                  f"{', '.join(k for k, v in (lead.get('sizes_that_fit') or {}).items() if v) or 'n/a'}",
                  *routes_markdown(lead.get("r3")), ""]
        lines += ["| memory tag | GB freed by its release |", "|---|---|"]
        lines += [f"| {tag} | {gb} |" for tag, gb in (lead.get("gpu_freed_gb_per_tag") or {}).items()] + [""]
        lines += ["| log-prob vs megatron | max abs | mean abs |", "|---|---|---|"]
        for tag in ("before_sleep", "after_wake"):
            lines.append(f"| {tag} | {lead[f'logprob_max_abs_diff_{tag}']:.3e} | "
                         f"{lead[f'logprob_mean_abs_diff_{tag}']:.3e} |")
        lines += ["", "| phase | rank 0 (s) | slowest rank (s) |", "|---|---|---|"]
        for name, sec in lead["phases"].items():
            slowest = max(r["phases"].get(name, 0) for r in run["ranks"] if r.get("ok"))
            lines.append(f"| {name} | {sec:.3f} | {slowest:.3f} |")
    return "\n".join(lines) + "\n"


def verdict(run: dict) -> bool:
    """Whether one TP's run passed. Tokens are compared only where this build repeats a seed
    (PR #17172); log-probs always; R3 routes where the checkpoint is MoE."""
    lead = run["ranks"][0]
    return bool(run["ok"] and (lead.get("same_tokens_after_wake") or not lead.get("seed_repeats"))
                and max(lead["logprob_max_abs_diff_before_sleep"], lead["logprob_max_abs_diff_after_wake"]) <= TOL
                and (lead.get("r3") is None or lead["r3"]["passed"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", default="trtllm_check_report")
    parser.add_argument("--max-tokens", type=int, default=32)
    # verl's meaning: the engine's share of the GPU, weights included, with the frozen policy's
    # weights counted as already in use (megarl/rollout/trtllm/resources.py kv_fraction).
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--tp", type=int, default=None, help="only this rollout TP (default: 1, and 2 where two GPUs)")
    opts = parser.parse_args(argv)
    problem = preflight()
    if problem:
        print(f"trtllm_check: {problem}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(opts.model, "config.json")):
        print(f"trtllm_check: --model {opts.model} has no config.json: pass an HF checkpoint directory",
              file=sys.stderr)
        return 2
    import torch
    args = {"max_tokens": opts.max_tokens, "gpu_memory_utilization": opts.gpu_memory_utilization,
            "timeout": opts.timeout}
    gpus = torch.cuda.device_count()
    if opts.tp is not None and not 1 <= opts.tp <= gpus:
        print(f"trtllm_check: --tp {opts.tp} needs {opts.tp} GPUs on this node, which has {gpus}", file=sys.stderr)
        return 2
    runs = []
    for tp in [opts.tp] if opts.tp else [1, 2] if gpus >= 2 else [1]:
        run = run_tp(tp, opts.model, args)
        run["verdict"] = verdict(run)
        runs.append(run)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable] + sys.argv), "versions": versions(), "tolerance": TOL, "runs": runs}
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "trtllm_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(opts.out, "trtllm_check.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    print(f"report: {opts.out}/trtllm_check.md and .json: please send both back")
    return 0 if all(r["verdict"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
