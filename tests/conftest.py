import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)  # tests refer to configs/ and benchmarks/ relative to the repository root
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
