"""The reward curve: training reward and held-out accuracy per step, from metrics.jsonl.

    python -m megarl.trainer.metrics.plot runs/megarl/quickstart      # writes reward_curve.png there
"""
from __future__ import annotations

import os
import sys

from megarl.trainer.metrics.logger import read_metrics


def plot_reward_curve(run_dir: str, out: str | None = None) -> str | None:
    rows = read_metrics(run_dir)
    train = [(r["step"], r["critic/score/mean"]) for r in rows if isinstance(r.get("critic/score/mean"), (int, float))]
    val = [(r["step"], r["val/accuracy"]) for r in rows if isinstance(r.get("val/accuracy"), (int, float))]
    if not train and not val:
        return None
    import matplotlib  # optional at run time: only for the reward-curve PNG (trainer.plot_reward_curve)
    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt  # after use("Agg"), which must precede it

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="training reward (critic/score/mean)", color="tab:blue", alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="held-out accuracy (val/accuracy)", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(os.path.basename(os.path.normpath(run_dir)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = out or os.path.join(run_dir, "reward_curve.png")
    tmp = out + ".tmp.png"      # renamed into place whole: a full disk leaves the old curve, not 0 bytes
    try:
        fig.savefig(tmp)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def plot_after_run(run_dir: str, say) -> None:
    """The curve at the end of a run, which may be ending on a full disk: a failure is one line from
    `say`, never a second exception chained to the one that ended the run."""
    try:
        path = plot_reward_curve(run_dir)
    except Exception as err:  # matplotlib's and the filesystem's errors alike: the run's outcome stands
        say(f"megarl: the reward curve was not written ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
        return
    if path:
        say(f"megarl: reward curve: {path}")


if __name__ == "__main__":
    print(plot_reward_curve(sys.argv[1]) or "no reward metrics found")
