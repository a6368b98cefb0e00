"""Twenty-one of verl's example scripts as a verl user types them, and what megarl makes of each override.

    python -m tests.helpers.verl_scripts          (from the repository root: prints docs/verl.md's table)
    python -m tests.helpers.verl_scripts grpo_math --model M --data D [--ranks 1]
                                                  (megarl's command for one script, refused overrides left out)

The overrides are those of volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7 (the
nearest to 0.9.1 stored here; the scripts' keys are the same in 0.9.1's trees), with each shell
variable written out at the script's value. `megarl_overrides` makes only the changes docs/verl.md
lists: local model and data paths, sizes (batches, lengths, ranks), and the engine name.
Each override is then one of
- implemented: megarl reads the key and acts on it;
- accepted at verl's default: a verl key megarl drops at that value (megarl/config/verl_keys.py);
- refused: one line naming megarl's way (the run goes on once the override is left out);
- unknown: "unknown key";
- failed badly: anything else (a traceback, a message of several lines).
"""
from __future__ import annotations

import argparse
import fnmatch
import shlex

import yaml

from megarl.config import ConfigError
from megarl.experiment import ExperimentConfig, load_config
from megarl.config.refused import ALIASES, RENAMED, moved_from
from megarl.config.verl_keys import megarl_implements
from tests.helpers.verl_scripts_algos import ALGORITHM_SCRIPTS
from tests.helpers.verl_scripts_async import LAYOUT_ASYNC_SCRIPTS

COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
CLASSES = ("implemented", "accepted at verl's default", "refused", "unknown", "failed badly")

_GSM8K_MATH = ["data.train_files=['gsm8k/train.parquet', 'math/train.parquet']",
               "data.val_files=['gsm8k/test.parquet', 'math/test.parquet']"]
_TAIL = ["algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console','wandb']"]

SCRIPTS: dict[str, dict] = {
    "grpo_math": {
        "path": "examples/grpo_trainer/run_qwen2-7b_math.sh",
        "overrides": [
            "algorithm.adv_estimator=grpo", *_GSM8K_MATH, "data.train_batch_size=1024",
            "data.max_prompt_length=1024", "data.max_response_length=1024", "data.filter_overlong_prompts=True",
            "data.truncation='error'", "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", *_TAIL,
            "trainer.project_name='verl_grpo_example_gsm8k_math'", "trainer.experiment_name='qwen2_7b_function_rm'",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
            "trainer.total_epochs=15"]},
    "grpo_math_megatron": {
        "path": "examples/grpo_trainer/run_qwen2-7b_math_megatron.sh",
        "overrides": [
            "algorithm.adv_estimator=grpo", *_GSM8K_MATH, "data.return_raw_chat=True", "data.train_batch_size=1024",
            "data.max_prompt_length=1024", "data.max_response_length=1024", "data.filter_overlong_prompts=True",
            "data.truncation='error'", "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
            "actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
            "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", *_TAIL,
            "trainer.project_name='verl_grpo_example_gsm8k_math'", "trainer.experiment_name='qwen2_7b_megatron'",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
            "trainer.total_epochs=15"]},
    "ppo_math_gsm8k_megatron": {
        "path": "examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh",
        "overrides": [
            "algorithm.adv_estimator=gae", *_GSM8K_MATH, "data.train_batch_size=1024", "data.max_prompt_length=1024",
            "data.max_response_length=512", "data.filter_overlong_prompts=True", "data.truncation='error'",
            "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "critic.optim.lr=1e-5",
            "critic.model.path=Qwen/Qwen2-7B-Instruct", "critic.ppo_micro_batch_size_per_gpu=4", *_TAIL,
            "trainer.project_name='verl_ppo_gsm8k_math_examples'", "trainer.experiment_name='qwen2_7b_megatron'",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
            "trainer.total_epochs=100"]},
    "dapo_e2e": {
        "path": "tests/special_e2e/run_dapo.sh",
        "overrides": [
            "data.train_files=gsm8k/train.parquet", "data.val_files=gsm8k/test.parquet",
            "reward_model.reward_manager=dapo", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
            "algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.actor.kl_loss_coef=0.0", "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28", "data.max_prompt_length=1024",
            "data.max_response_length=2048", "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=128", "reward_model.overlong_buffer.penalty_factor=1.0",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean", "data.train_batch_size=16",
            "data.gen_batch_size=64", "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.max_num_gen_batches=10",
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.use_fused_kernels=True",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True", "trainer.logger=console",
            "trainer.project_name='verl-test'", "trainer.experiment_name=qwen2.5-0.5b-instruct-dapo-minimal",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.total_epochs=2",
            "trainer.resume_mode=disable", "trainer.val_before_train=False", "trainer.total_training_steps=1"]},
    "multiturn_megatron": {
        "path": "examples/sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh "
                "with config/gsm8k_multiturn_megatron_grpo.yaml",
        # the YAML's leaves (its hydra: and defaults: sections removed, as docs/verl.md says), then the script's
        "yaml": ["data.max_prompt_length=1024", "data.max_response_length=1024", "data.train_batch_size=256",
                 "data.return_raw_chat=True", "actor_rollout_ref.hybrid_engine=True",
                 "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.multi_turn.enable=True",
                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5"],
        "overrides": [
            "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=1024",
            "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation='error'",
            "data.return_raw_chat=True", "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.actor.megatron.seed=42",
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.context_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16", "algorithm.use_kl_in_reward=False",
            "trainer.critic_warmup=0", "trainer.logger=['console','wandb']", "trainer.project_name='gsm8k_async_rl'",
            "trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-n8-mcore-v2505201745_seed42'",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=20",
            "data.train_files=gsm8k_multiturn/train.parquet", "data.val_files=gsm8k_multiturn/test.parquet",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=tool_config/gsm8k_tool_config.yaml",
            "trainer.total_epochs=15"]},
    "ppo_rm": {
        "path": "examples/ppo_trainer/run_qwen2-7b_rm.sh",
        "overrides": [
            "algorithm.adv_estimator=gae", *_GSM8K_MATH, "data.train_batch_size=1024", "data.max_prompt_length=1024",
            "data.max_response_length=512", "data.filter_overlong_prompts=True", "data.truncation='error'",
            "data.return_raw_chat=True", "actor_rollout_ref.model.path=models/Qwen2-7B-Instruct",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.actor.fsdp_config.param_offload=False",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "critic.optim.lr=1e-5",
            "critic.model.use_remove_padding=True", "critic.optim.lr_warmup_steps_ratio=0.05",
            "critic.model.path=models/Qwen2-7B-Instruct", "critic.model.enable_gradient_checkpointing=True",
            "critic.ppo_micro_batch_size_per_gpu=32", "critic.model.fsdp_config.param_offload=False",
            "critic.model.fsdp_config.optimizer_offload=False", "reward_model.enable=True",
            "reward_model.model.path=models/FsfairX-LLaMA3-RM-v0.1", "reward_model.use_reward_loop=True",
            "reward_model.rollout.name=vllm", "reward_model.rollout.gpu_memory_utilization=0.8",
            "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=2048",
            "reward_model.rollout.response_length=1024", "reward_model.num_workers=8", *_TAIL,
            "trainer.project_name='verl_example'", "trainer.val_before_train=False",
            "trainer.experiment_name='Qwen2-7B-Instruct_hybrid_rm'", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
            "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15"]},
}

SCRIPTS.update(ALGORITHM_SCRIPTS)
SCRIPTS.update(LAYOUT_ASYNC_SCRIPTS)

# The changes docs/verl.md lists, by key glob: the model and data are local, the sizes small, the
# engine megarl's. A value given here replaces the script's; any other override is typed as verl's.
ENGINE = "native"


def changes(model: str, data: str, ranks: int = 8) -> dict[str, str]:
    """key glob -> value: a tiny local model at `model`, verl-shaped parquet under `data`, `ranks` ranks
    (under the scripts' 8, every layout size 1)."""
    small = {"*.megatron.*_parallel_size": "1", "actor_rollout_ref.rollout.tensor_model_parallel_size": "1"}
    return {**(small if ranks < 8 else {}),
        "*.model.path": model,
        "data.train_batch_size": "16", "data.max_prompt_length": "256",
        "data.max_response_length": "16", "reward_model.reward_kwargs.max_resp_len": "16",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "16",
        "*micro_batch_size_per_gpu": "2", "actor_rollout_ref.rollout.n": "2",
        "actor_rollout_ref.rollout.name": ENGINE,
        "trainer.n_gpus_per_node": str(ranks), "trainer.total_epochs": "1", "trainer.total_training_steps": "1",
        "trainer.logger": "[console]",
    }


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+").strip()


def megarl_overrides(name: str, model: str = "models/tiny-qwen2", data: str = "data/verl_math",
                     ranks: int = 8) -> tuple[list[str], list[str]]:
    """(the script's overrides with docs/verl.md's changes applied, the keys changed)."""
    table = changes(model, data, ranks)
    script = SCRIPTS[name]
    out, changed = [], []
    for text in [*script.get("yaml", []), *script["overrides"]]:
        key = key_of(text)
        glob = next((g for g in table if fnmatch.fnmatchcase(key, g)), None)
        if key in ("data.train_files", "data.val_files"):        # the script's files, under `data`
            files = yaml.safe_load(text.split("=", 1)[1])
            files = [files] if isinstance(files, str) else files
            text = f"{key}=[{','.join(f'{data}/{f}' for f in files)}]"
            changed.append(key)
        elif glob is not None and f"{key}={table[glob]}" != text:
            text = f"{key}={table[glob]}"
            changed.append(key)
        out.append(text)
    return out, sorted(set(changed))


def _culprit(err: ConfigError, left: list[str]) -> str | None:
    if err.key is None:
        return next((o for o in left if repr(o) in str(err) or o in str(err)), None)
    for text in reversed(left):          # the last setting of a key is the one that counts
        key = key_of(text)
        if key == err.key or err.key.startswith(key + ".") or key.startswith(err.key + "."):
            return text
    return None


def classify(overrides: list[str]) -> dict[str, str]:
    """override -> one of CLASSES, loading the whole list through megarl's config in this process;
    each refused override is left out and the rest loaded again, as a user would."""
    out: dict[str, str] = {}
    left = list(overrides)
    while True:
        try:
            load_config(None, left)
            break
        except ConfigError as err:
            text = _culprit(err, left)
            if text is None:
                raise AssertionError(f"no override of the script is named by: {err}") from None
            message = str(err)
            out[text] = ("unknown" if "unknown key" in message else "failed badly" if "\n" in message
                         else "refused")
            left = [o for o in left if o != text]
        except Exception as err:            # noqa: BLE001 -- what is not a ConfigError is the finding
            bad = [o for o in left if _fails_badly(o)] or left
            out.update({o: f"failed badly ({type(err).__name__})" for o in bad})
            left = [o for o in left if o not in bad]
    for text in left:
        key = key_of(text)
        ours = (megarl_implements(key, ExperimentConfig) or key in ALIASES or key in RENAMED
                or moved_from(key) is not None)
        out.setdefault(text, "implemented" if ours else "accepted at verl's default")
    return out


def _fails_badly(text: str) -> bool:
    try:
        load_config(None, [text])
    except ConfigError:
        return False
    except Exception:                       # noqa: BLE001
        return True
    return False


def counts(classes: dict[str, str]) -> dict[str, int]:
    return {c: sum(1 for v in classes.values() if v.split(" (")[0] == c) for c in CLASSES}


def table() -> str:
    lines = ["| script (verl, commit " + COMMIT[:8] + ") | overrides | changed | " + " | ".join(CLASSES)
             + " | refused (megarl's way in the line) |", "|" + "---|" * (len(CLASSES) + 4)]
    for name, script in SCRIPTS.items():
        overrides, changed = megarl_overrides(name)
        classes = classify(overrides)
        got = counts(classes)
        refused = ", ".join(f"`{o}`" for o, c in classes.items() if c == "refused")
        lines.append(f"| `{script['path']}` | {len(overrides)} | {len(changed)} | "
                     + " | ".join(str(got[c]) for c in CLASSES) + f" | {refused} |")
    return "\n".join(lines)


def command(name: str, model: str, data: str, ranks: int) -> str:
    overrides, _ = megarl_overrides(name, model, data, ranks)
    classes = classify(overrides)
    kept = [o for o in overrides if classes[o] != "refused"]
    return "python -m megarl.train \\\n  " + " \\\n  ".join(shlex.quote(o) for o in kept)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="verl's example scripts in megarl")
    parser.add_argument("script", nargs="?", choices=sorted(SCRIPTS))
    parser.add_argument("--model", default="models/tiny-qwen2")
    parser.add_argument("--data", default="data/verl_math")
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    print(command(args.script, args.model, args.data, args.ranks) if args.script else table())
