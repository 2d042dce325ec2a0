"""The ``calculator`` tool: arithmetic on an expression, evaluated over its syntax tree (never
``eval``): numbers, + - * / // % **, unary signs, parentheses and a few functions (sqrt, abs,
round, floor, ceil). Anything else is an error text, never an exception.

Integers stay exact however large (within ``max_digits``): ``/`` of two integers that divide
evenly gives an integer, so ``10**30 / 10`` is ``10**29`` exactly, not ``1e+29``. A whole float
prints without ".0". Every operation is bounded before it runs (exponent size, result digits,
``round``'s digits), because a single ``9**9**9`` would hold the process for minutes.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable
from typing import Any

from megarl.envs.tools.base import ToolResult

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# name -> (function, smallest and largest number of arguments)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "sqrt": (math.sqrt, 1, 1), "abs": (abs, 1, 1), "round": (round, 1, 2),
    "floor": (math.floor, 1, 1), "ceil": (math.ceil, 1, 1),
}
_LOG10_2 = math.log10(2)


class CalculatorError(ValueError):
    """What the policy reads back: the expression is not arithmetic, or too big."""


class Calculator:
    name = "calculator"

    def __init__(self, max_chars: int = 200, max_exponent: int = 1000, max_digits: int = 100):
        for option, value in (("max_chars", max_chars), ("max_exponent", max_exponent), ("max_digits", max_digits)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"calculator option {option} must be a positive integer, got {value!r}")
        self.max_chars, self.max_exponent, self.max_digits = max_chars, max_exponent, max_digits
        self._int_bound = 10**max_digits  # compared against, so no result is ever turned into a decimal string

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name,
            "description": "Evaluates an arithmetic expression, e.g. 12 * (3 + 4), and returns the exact result.",
            "parameters": {"type": "object", "required": ["expression"],
                           "properties": {"expression": {
                               "type": "string",
                               "description": "numbers, + - * / // % ** and parentheses; sqrt, abs, round, "
                                              "floor, ceil"}}},
        }}

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        started = time.perf_counter()
        try:
            text = _format(self.evaluate(_expression(arguments)))
        except CalculatorError as exc:
            return ToolResult(f"error: {exc}", error=True, seconds=time.perf_counter() - started)
        return ToolResult(text, seconds=time.perf_counter() - started)

    def evaluate(self, expression: str) -> Number:
        """The expression's value; ``CalculatorError`` for anything that is not bounded arithmetic."""
        if len(expression) > self.max_chars:
            raise CalculatorError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
            return self._value(tree.body)
        except SyntaxError as exc:
            raise CalculatorError(f"not an arithmetic expression ({exc.msg})") from None
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        except (RecursionError, MemoryError):  # the parser's nesting limit; only far above max_chars' default
            raise CalculatorError("the expression is nested too deeply") from None
        except CalculatorError:
            raise
        except ValueError as exc:  # math domain errors: sqrt(-1)
            raise CalculatorError(str(exc)) from None

    def _value(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Constant) and _is_number(node.value):
            return self._bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return self._binary(node.op, self._value(node.left), self._value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            return self._call(node.func.id, node)
        raise CalculatorError(f"{_source(node)!r} is not arithmetic (numbers, + - * / // % ** and "
                              f"{', '.join(_FUNCTIONS)})")

    def _binary(self, op: ast.operator, left: Number, right: Number) -> Number:
        if isinstance(op, ast.Pow):
            self._check_power(left, right)
        if isinstance(op, ast.Div) and isinstance(left, int) and isinstance(right, int) and right and not left % right:
            return self._bounded(left // right)  # exact: a float would round integers above 2**53
        return self._bounded(_BINARY[type(op)](left, right))

    def _check_power(self, base: Number, exponent: Number) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(f"exponent {_format(exponent)} is larger than {self.max_exponent}")
        # An integer power's size is known before computing it: digits ~ exponent * log10(|base|).
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            if exponent * (abs(base).bit_length() - 1) * _LOG10_2 > self.max_digits:
                raise CalculatorError(f"the result has more than {self.max_digits} digits")

    def _call(self, name: str, node: ast.Call) -> Number:
        function, least, most = _FUNCTIONS[name]
        if node.keywords or not least <= len(node.args) <= most:
            count = f"{least}" if least == most else f"{least} or {most}"
            raise CalculatorError(f"{name}() takes {count} positional argument(s)")
        args = [self._value(a) for a in node.args]
        if name == "round" and len(args) == 2:
            digits = args[1]
            # round(5, -10**50) would build 10**(10**50); a bound keeps it to microseconds
            if not isinstance(digits, int) or abs(digits) > self.max_digits:
                raise CalculatorError(f"round()'s digits must be an integer within +-{self.max_digits}")
        return self._bounded(function(*args))

    def _bounded(self, value: Any) -> Number:
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(value, int) and abs(value) >= self._int_bound:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("the result is not finite")
        return value


def _expression(arguments: Any) -> str:
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if _is_number(expression):  # a model that writes {"expression": 42} meant the number
        return str(expression)
    if not isinstance(expression, str):
        raise CalculatorError('"expression" must be a string such as "12 * 34"')
    return expression


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _source(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _format(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)
