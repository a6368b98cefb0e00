"""The run's step directories: save and resume (checkpointing.py), every file verified against
its manifest (verified_io.py), and staging to and from other storage (staging.py)."""
