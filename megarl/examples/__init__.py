"""Small self-contained tasks: the CPU quickstart's addition task lives in `addition/`."""
