"""Pieces the tests share (no test module imports another):

    megatron_roles.py     batches, losses, transformers references, make_actor at any layout
    training_runs.py      `python -m megarl.train` runs as users start them, stable metrics, kill_tree
    checkpoint_engine.py  actors, native engines and rollout groups for the weight-sync tests
    multiturn.py          the scripted stand-in engine and prompt batches of the agent-loop tests
    reward.py             rollout batches and tokenizers for the reward tests
    worker_checks.py      the worker checks run over gloo here and on CUDA in tests/gpu
"""
