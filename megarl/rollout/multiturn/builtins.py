"""Tool implementations megarl ships (`implementation: builtin:<name>` in tools.yaml).

    calculator(a, b)        a + b: verl's rollout guide's "calculator: Add two numbers together"
    calculate(expression)   an arithmetic expression (+ - * / // % ** and parentheses) evaluated
                            over the expression's syntax tree, never with eval(); every
                            intermediate result is bounded (MAX_BITS) before it is computed

A tools.yaml entry named `calculator` or `calculate` with no implementation and these exact
parameter names uses the built-in (and says so at start). There is no built-in `search`: this
framework runs without internet access, so such a tool needs an implementation of your own.
"""
from __future__ import annotations

import ast
import operator


def calculator(a: float, b: float) -> float:
    """Add two numbers together."""
    return a + b


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64            # 10**64 is big enough for arithmetic word problems, small enough to stay instant
# Every intermediate integer stays under 2**MAX_BITS (about 10**308, a float's range), checked
# *before* the operation: each step then costs microseconds, so no expression of 200 characters
# can hold the GIL (a thread cannot be stopped) past the tool's time limit.
MAX_BITS = 1024


def _bits(x: int | float) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0   # floats overflow by themselves (OverflowError)


def _check_size(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse an operation whose exact integer result could exceed MAX_BITS, without computing it."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {str(right)[:20]} is too large (limit {MAX_EXPONENT})")
        bound = _bits(left) * right if isinstance(right, int) and right > 0 else 0
    elif isinstance(op, ast.Mult):
        bound = _bits(left) + _bits(right)
    else:                    # + - add at most one bit; / // % never grow past their operands
        bound = max(_bits(left), _bits(right)) + 1
    if bound > MAX_BITS:
        raise ValueError(f"an intermediate result would have about {int(bound * 0.30103)} digits "
                         f"(limit {int(MAX_BITS * 0.30103)})")


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if _bits(node.value) > MAX_BITS:
            raise ValueError(f"number too large (limit {int(MAX_BITS * 0.30103)} digits)")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(node.op, left, right)
        try:
            return _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError("result out of range") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression such as "(3 + 4) * 2"."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    return _evaluate(tree)


BUILTINS = {"calculator": calculator, "calculate": calculate}
