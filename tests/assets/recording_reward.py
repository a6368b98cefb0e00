"""A reward manager (reward_model.reward_manager=tests/assets/recording_reward.py:RecordingReward)
that records every call to `log_path`, one JSON line per call: each row's uid, prompt and response
text, response mask and the score it gave. The score is the response's character count / 4, so it
varies within a prompt's group (tests/test_trainer_remax.py)."""
import json

import torch


class RecordingReward:
    def __init__(self, log_path: str):
        self.log_path = log_path

    def __call__(self, data):
        nt = data.non_tensor_batch
        scores = [len(text) / 4 for text in nt["response_text"]]
        call = {"uid": [str(u) for u in nt["uid"]], "prompt": list(nt["prompt_text"]),
                "response": list(nt["response_text"]), "score": scores,
                "response_mask": data.batch["response_mask"].int().tolist()}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(call) + "\n")
        return torch.tensor(scores)
