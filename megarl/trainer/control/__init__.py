"""How a run stops: stop requests from signals (stopping.py), out-of-memory errors named with
the key to lower (out_of_memory.py), and the fault points the fault tests kill ranks at (faults.py)."""
