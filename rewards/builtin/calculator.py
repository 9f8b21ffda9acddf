"""An example environment: arithmetic questions, a calculator tool, and a graded final answer.

Small enough to read in one sitting and to train a tiny model on: it shows a tool with a pydantic
argument model and a terminal tool that grades the plain final message. Registered as
``calculator`` in this project's entry points.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from rewards.env import Environment, ToolResult, tool

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate(expression: str) -> float:
    """Evaluate + - * / and parentheses on numbers; anything else is a ValueError."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return ev(ast.parse(expression, mode="eval").body)


def make_task(rng: random.Random) -> dict[str, Any]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    expression = f"{a} * {c} + {b}" if rng.random() < 0.5 else f"({a} + {b}) * {c}"
    return {"question": f"What is {expression}?", "answer": evaluate(expression)}


class Calculate(BaseModel):
    expression: str = Field(description="an arithmetic expression, e.g. (3 + 4) * 2")


class Answer(BaseModel):
    answer: str


class CalculatorEnv(Environment):
    """Answer an arithmetic question; a calculator tool is available."""

    SIZES: ClassVar[dict[str, int]] = {"train": 1000, "test": 100}

    @classmethod
    def list_splits(cls) -> list[str]:
        return list(cls.SIZES)

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        if split not in cls.SIZES:
            raise ValueError(f"unknown split {split!r}; splits are {list(cls.SIZES)}")
        rng = random.Random(f"calculator-{split}")
        return [make_task(rng) for _ in range(cls.SIZES[split])]

    def get_prompt(self) -> str:
        return f"{self.task['question']} Use the calculator if you need it, then state the number."

    @tool
    def calculate(self, args: Calculate) -> ToolResult:
        """Evaluate an arithmetic expression (+, -, *, /, parentheses)."""
        try:
            return ToolResult(text=f"{evaluate(args.expression):g}")
        except (ValueError, SyntaxError, ZeroDivisionError) as e:
            return ToolResult(text=f"Error: {e}", is_error=True)

    @tool(terminal=True)
    def submit(self, args: Answer) -> ToolResult:
        """Grade the final answer: the last number in it must equal the expected value."""
        numbers = _NUMBER.findall(args.answer.replace(",", ""))
        correct = bool(numbers) and abs(float(numbers[-1]) - self.task["answer"]) < 1e-6
        return ToolResult(
            text="correct" if correct else "incorrect", reward=float(correct), finished=True
        )
