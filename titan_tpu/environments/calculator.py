"""A question-and-answer environment whose one tool is a calculator.

Built in as `rl.env = "calculator"` (titan_tpu/tasks/grpo/environments.py), with `rl.env_args` as its
keyword arguments.

The tool evaluates arithmetic with titan_tpu/environments/arithmetic.py, which walks the expression's
syntax tree and never runs it; the reward is 1.0 when the final answer matches the record's reference.
"""

from __future__ import annotations

from titan_tpu.environments.arithmetic import ExpressionError, evaluate, format_number
from titan_tpu.environments.question import QuestionEnvironment
from titan_tpu.environments.tool_env import Tool, ToolError


def calculate(expression: str) -> str:
    try:
        return format_number(evaluate(expression))
    except ExpressionError as error:
        raise ToolError(str(error)) from None


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example (12 + 3) * 4 / 5"}},
        "required": ["expression"],
    },
    run=calculate,
)


class Calculator(QuestionEnvironment):
    """Built with `rl.env_args`: `prompt_field`, `answer_field` and `system_prompt` (QuestionEnvironment),
    and `offer_tools`: False offers no tool, for a baseline of the same questions without one (every
    call is then answered "error: no tools are offered in this episode")."""

    def __init__(
        self,
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        system_prompt: str = "",
        offer_tools: bool = True,
    ) -> None:
        super().__init__(
            [CALCULATOR] if offer_tools else [],
            prompt_field=prompt_field,
            answer_field=answer_field,
            system_prompt=system_prompt,
        )
