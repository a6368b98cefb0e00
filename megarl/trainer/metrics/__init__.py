"""What a run records: the metrics log and its backends (logger.py), verl's per-step and
validation metrics, MFU, per-phase memory, the generations dump and the reward-curve plot."""
