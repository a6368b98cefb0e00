"""Tool implementations megarl ships (`implementation: builtin:<name>` in tools.yaml).

    calculator(a, b)        a + b: seed 000's "calculator: Add two numbers together"
    calculate(expression)   an arithmetic expression (+ - * / // % ** and parentheses) evaluated
                            over the expression's syntax tree, never with eval()

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


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (limit {MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
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
