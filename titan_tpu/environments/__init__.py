"""Built-in multi-turn environments (titan_tpu/protocols/environment.py) and the pieces to write one.

- tool_env.py: `ToolEnvironment`, the protocol's `step` for environments whose actions are tool calls,
  and `reference_match`, the reward of a final answer against a reference;
- question.py: `QuestionEnvironment`, a record's question in, its reference answer as the reward;
- calculator.py: `Calculator` (`rl.env = "calculator"`), with arithmetic.py's evaluator as its tool;
- python_tool.py: `PythonEnv` (`rl.env = "python"`), with sandbox.py's bounded Python runs as its tool.

Import each name from its module.
"""
