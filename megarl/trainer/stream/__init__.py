"""The asynchronous loop (placement=disaggregated): the rollout ranks stream batches
(worker.py, buffer.py, groups.py) while the trainer ranks run the shared step (fit.py), the two
sides exchanging starts, hand-offs and update signals (messages.py)."""
