"""A question-and-answer environment whose one tool runs Python in a sandbox.

Built in as `rl.env = "python"` (titan_tpu/tasks/grpo/environments.py), with `rl.env_args` as its keyword
arguments.

Each call runs the model's code in titan_tpu/environments/sandbox.py (a separate, bounded process; the
trainer never runs it) and answers with what a terminal would show: the output, the exit status and
why the run was stopped. A run that did not end with status 0 is answered as an error and counted in
`tool_errors`; one stopped by a time limit is counted in `timeouts` too.
"""

from __future__ import annotations

import math

from titan_tpu.environments.question import QuestionEnvironment
from titan_tpu.environments.sandbox import SandboxLimits, run_python
from titan_tpu.environments.tool_env import Tool, ToolResult


class PythonEnv(QuestionEnvironment):
    """Built with `rl.env_args`: `prompt_field`, `answer_field` and `system_prompt` (QuestionEnvironment);
    `offer_tools` (False: no tool, for a baseline); and the sandbox's limits per run: `timeout` (wall
    clock seconds; the CPU time limit is the same, rounded up), `memory_mb` (address space) and
    `max_output_bytes` (the output shown; the run is killed past 64 times that, at least 1 MiB)."""

    def __init__(
        self,
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        system_prompt: str = "",
        offer_tools: bool = True,
        timeout: float = 5.0,
        memory_mb: int = 256,
        max_output_bytes: int = 16 * 1024,
    ) -> None:
        self.limits = SandboxLimits(
            wall_seconds=timeout,
            cpu_seconds=max(1, math.ceil(timeout)),
            memory_mb=memory_mb,
            max_output_bytes=max_output_bytes,
            output_stop_bytes=max(64 * max_output_bytes, 1 << 20),
        )
        tool = Tool(
            name="python",
            description=(
                "Run a Python program (standard library only, no network, no files outside its folder) and see "
                "what it prints. Print the values you need."
            ),
            parameters={
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the whole program"}},
                "required": ["code"],
            },
            run=self.run_code,
        )
        super().__init__(
            [tool] if offer_tools else [],
            prompt_field=prompt_field,
            answer_field=answer_field,
            system_prompt=system_prompt,
        )

    def run_code(self, code: str) -> ToolResult:
        result = run_python(code, self.limits)
        return ToolResult(result.as_tool_text(), failed=not result.ok, timed_out=result.timed_out)
