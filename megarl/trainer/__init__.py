"""The trainer: the loops that turn a run's parts into training steps, below the config's
composition root (megarl/experiment.py reads this package's section, megarl/trainer/config.py).

    loop/         the synchronous step: generate, score, advantages, update, sync (RLTrainer)
    stream/       the asynchronous loop: a rollout stream beside training, its buffer and messages
    checkpoints/  the run's step directories: save, verify, stage, resume
    metrics/      what a run records: metrics, throughput, memory, generations, plots
    control/      how a run stops: signals, out-of-memory, fault points for the fault tests

megarl/job/ builds the parts from the config and runs these loops on each rank.
"""
