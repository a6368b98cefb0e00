"""A reward that varies within some groups and not others (tests/test_trainer_features.py), so
DAPO's dynamic sampling drops groups and must generate again: 1 when the response has an even
number of characters."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    even = float(len(solution_str) % 2 == 0)
    return {"score": even, "acc": even}
