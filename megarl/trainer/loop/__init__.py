"""The synchronous step loop (RLTrainer, fit.py) and the pieces of one step: generation,
baselines, the rollout-correction bypass, validation, and the parts the loop runs on."""
