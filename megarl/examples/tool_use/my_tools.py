"""Example tool implementations for tools.yaml: `implementation: my_tools.py:multiply`.

A tool is a plain function called with the model's arguments as keywords (already checked
against the tool's parameters); it returns a string, or anything JSON can encode.
"""


def multiply(a: float, b: float) -> float:
    return a * b
