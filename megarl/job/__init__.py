"""One job on its ranks, composed from the run's ExperimentConfig (above the composition root
megarl/experiment.py): the ranks and their groups (ranks.py, launch_env.py), the run's parts
(build.py), and the run itself (run.py, which megarl-train starts on every rank)."""
