"""Running out of memory, said in one line: which phase of the step, and what to lower.

A rank that hits its memory limit (a GPU's memory, the host's, or an address-space limit such as
`ulimit -v` or Slurm's --mem) raises MemoryError or torch's allocator error deep inside a kernel;
the trainer's phases (Steps.timed) turn it into OutOfMemory carrying the phase's name, and
megarl/job/run.py prints it as one line.
"""
from __future__ import annotations

import resource

# phase -> the keys that size it
_LOWER = {
    "gen": "data.train_batch_size, actor_rollout_ref.rollout.n or data.max_response_length "
           "(or actor_rollout_ref.rollout.gpu_memory_utilization)",
    "old_log_prob": "actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu "
                    "(or rollout.log_prob_max_token_len_per_gpu)",
    "ref": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu (or ref.log_prob_max_token_len_per_gpu)",
    "values": "critic.ppo_micro_batch_size_per_gpu (or critic.forward_max_token_len_per_gpu)",
    "update_actor": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu), "
                    "or offload with actor_rollout_ref.actor.megatron.optimizer_offload=true",
    "update_critic": "critic.ppo_micro_batch_size_per_gpu (or critic.ppo_max_token_len_per_gpu)",
    "reward": "reward_model.micro_batch_size_per_gpu or data.train_batch_size",
    "testing": "data.val_batch_size or actor_rollout_ref.rollout.val_kwargs.n",
    "sync": "actor_rollout_ref.rollout.checkpoint_engine.bucket_size_mb",
    "start-up": "the model's size per rank (raise tensor_model_parallel_size / pipeline_model_parallel_size) or "
                "the dataset's size",
}
_WORDS = ("can't allocate memory", "cannot allocate memory", "out of memory", "std::bad_alloc",
          "failed to allocate")


class OutOfMemory(RuntimeError):
    """A phase ran out of memory; str() is the one line megarl prints."""

    def __init__(self, phase: str, err: BaseException):
        self.phase = phase
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        cut = text.find("can't allocate memory")     # torch's CPU allocator: the words after its C++ assert
        detail = (text[cut:] if cut >= 0 else text)[:120]
        lower = _LOWER.get(phase, "the batch (data.train_batch_size) or the micro-batch sizes")
        super().__init__(f"ran out of memory during {phase} ({detail}){limit_note()}; lower {lower}, "
                         "or give the run more memory")


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, OutOfMemory)):
        return True
    name = type(err).__name__
    text = str(err).lower()
    if isinstance(err, (RuntimeError, OSError)) and "resource temporarily unavailable" in text:
        # Under an address-space limit a new thread's stack cannot be mapped: pthread_create fails
        # with EAGAIN, which gloo and torch report in these words (without a limit EAGAIN is about
        # process counts, not memory).
        return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    return name == "OutOfMemoryError" or (isinstance(err, RuntimeError) and any(w in text for w in _WORDS))


def limit_note() -> str:
    """' (address-space limit N GiB, ulimit -v)' where one is set."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return ""
    return f" under an address-space limit of {soft / 2**30:.1f} GiB (ulimit -v)"


def as_out_of_memory(phase: str, err: BaseException) -> BaseException:
    """`err` as OutOfMemory of `phase` where it is one (and not named already), else `err`."""
    if isinstance(err, OutOfMemory) or not is_out_of_memory(err):
        return err
    return OutOfMemory(phase, err)
