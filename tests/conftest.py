import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)  # tests refer to configs/ and benchmarks/ relative to the repository root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def addition_model_dir(tmp_path_factory):
    """The quickstart's model after a short warm start (60 steps, ~2 s): small and quick for runs
    of the real trainer that check mechanics, not learning. Built once per session."""
    from megarl.examples.addition import bootstrap
    path = str(tmp_path_factory.mktemp("model") / "addition")
    bootstrap(path, warm_start_steps=60, eval_rows=16, verbose=False)
    return path
