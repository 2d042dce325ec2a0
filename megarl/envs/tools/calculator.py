"""The ``calculator`` tool: exact arithmetic on an expression, evaluated over its syntax tree
(never ``eval``): numbers, + - * / // % **, unary signs, parentheses and a few functions.
Integers stay exact however large (within the bounds below); a whole float prints without ".0"."""

from __future__ import annotations

import ast
import math
import operator
import time
from typing import Any

from megarl.envs.tools.base import ToolResult

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil}


class CalculatorError(ValueError):
    """What the policy reads back: the expression is not arithmetic, or too big."""


class Calculator:
    name = "calculator"

    def __init__(self, max_chars: int = 200, max_exponent: int = 64, max_digits: int = 100):
        # bounds that keep one call to microseconds: 9**9**9 would take the process for minutes
        self.max_chars, self.max_exponent, self.max_digits = max_chars, max_exponent, max_digits

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name,
            "description": "Evaluates an arithmetic expression, e.g. 12 * (3 + 4), and returns the exact result.",
            "parameters": {"type": "object", "required": ["expression"],
                           "properties": {"expression": {"type": "string",
                                                         "description": "numbers, + - * / // % ** and parentheses"}}},
        }}

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        started = time.perf_counter()
        expression = arguments.get("expression")
        try:
            if not isinstance(expression, str | int | float) or isinstance(expression, bool):
                raise CalculatorError('"expression" must be a string such as "12 * 34"')
            text = str(expression)
            if len(text) > self.max_chars:
                raise CalculatorError(f"expression longer than {self.max_chars} characters")
            try:
                tree = ast.parse(text.strip(), mode="eval")
            except SyntaxError as exc:
                raise CalculatorError(f"not an arithmetic expression ({exc.msg})") from None
            value = self._value(tree.body)
        except (CalculatorError, ZeroDivisionError, OverflowError, ValueError) as exc:
            message = "division by zero" if isinstance(exc, ZeroDivisionError) else str(exc)
            return ToolResult(f"error: {message}", error=True, seconds=time.perf_counter() - started)
        return ToolResult(_format(value), seconds=time.perf_counter() - started)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return self._bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise CalculatorError(f"exponent {right} is larger than {self.max_exponent}")
            return self._bounded(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._value(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords and len(node.args) in (1, 2)):
            return self._bounded(_FUNCTIONS[node.func.id](*(self._value(a) for a in node.args)))
        raise CalculatorError(f"{ast.unparse(node)!r} is not arithmetic (numbers, + - * / // % ** and "
                              f"{', '.join(_FUNCTIONS)})")

    def _bounded(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(value, int) and len(str(abs(value))) > self.max_digits:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not finite")
        return value


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)
