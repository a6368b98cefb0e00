"""A reward function that misbehaves on purpose (tests/test_trainer_features.py): exact integer
match, but it raises for odd answers and hangs for answers ending in 0."""
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    truth = str(ground_truth).strip()
    if truth.endswith("0"):
        time.sleep(3600)
    if int(truth) % 2:
        raise ValueError(f"cannot score {truth}")
    ok = solution_str.strip() == truth
    return {"score": float(ok), "acc": float(ok)}
