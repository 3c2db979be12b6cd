"""titan_tpu/environments/tool_env.py, question.py, calculator.py and python_tool.py: how tool calls are
answered, when an episode ends, the reward, and the records refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from titan_tpu.environments.calculator import Calculator
from titan_tpu.environments.python_tool import PythonEnv
from titan_tpu.environments.tool_env import Tool, ToolEnvironment, ToolError, ToolResult, reference_match
from titan_tpu.protocols.environment import EpisodeStart, ModelTurn, RecordError, ToolCall


def _calls(*calls: tuple[str, Any]) -> ModelTurn:
    return ModelTurn(text="...", content="", tool_calls=tuple(ToolCall(name, args) for name, args in calls))


def _answer(content: str) -> ModelTurn:
    return ModelTurn(text=content, content=content)


class Toolbox(ToolEnvironment):
    """Tools that record their calls, and fail on demand."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, dict[str, Any]]] = []

        def add(a: int, b: int) -> str:
            self.ran.append(("add", {"a": a, "b": b}))
            return str(a + b)

        def echo(text: str) -> str:
            self.ran.append(("echo", {"text": text}))
            return text

        def broken(kind: str) -> str | ToolResult:
            if kind == "refuse":
                raise ToolError("refused on purpose")
            if kind == "slow":
                return ToolResult("stopped: time limit of 1 s", failed=True, timed_out=True)
            nothing: dict[str, str] = {}
            return nothing["missing"]  # a bug in the tool itself: KeyError

        def schema(**properties: str) -> dict[str, Any]:
            return {
                "type": "object",
                "properties": {name: {"type": kind} for name, kind in properties.items()},
                "required": list(properties),
            }

        super().__init__(
            [
                Tool("add", "a + b", schema(a="integer", b="integer"), add),
                Tool("echo", "its text", schema(text="string"), echo),
                Tool("broken", "fails", schema(kind="string"), broken),
            ]
        )

    def start(self, record: Mapping[str, Any]) -> EpisodeStart:
        return EpisodeStart(messages=[{"role": "user", "content": "hi"}], tools=self.tool_schemas())

    def reward(self) -> float:
        return 0.0


def test_calls_are_run_and_answered_in_order() -> None:
    """Bugs caught: results answered out of order or under the wrong tool name, a turn with calls taken
    for the final answer."""
    env = Toolbox()
    reply = env.step(_calls(("echo", {"text": "first"}), ("add", {"a": 2, "b": 3}), ("echo", {"text": "third"})))
    assert [(m["role"], m["name"], m["content"]) for m in reply.messages] == [
        ("tool", "echo", "first"),
        ("tool", "add", "5"),
        ("tool", "echo", "third"),
    ]
    assert env.ran == [("echo", {"text": "first"}), ("add", {"a": 2, "b": 3}), ("echo", {"text": "third"})]
    assert (reply.done, reply.tool_errors, reply.timeouts, env.answer) == (False, 0, 0, None)


def test_schemas_are_what_chat_templates_take() -> None:
    """Bug caught: a tool offered in another shape than apply_chat_template(tools=...) reads."""
    schema = Toolbox().start({}).tools[1]
    assert schema == {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "its text",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (("nope", {}), "error: unknown tool 'nope'; the tools are: add, echo, broken"),
        (("add", {"a": 1}), "error: add: missing argument 'b'"),
        (("add", {"a": 1, "b": 2, "c": 3}), "error: add: unexpected argument 'c'"),
        (("add", {"a": "1", "b": 2}), "error: add: argument 'a' must be integer, not string"),
        (("add", {"a": True, "b": 2}), "error: add: argument 'a' must be integer, not boolean"),
        (("add", [1, 2]), "error: add: the arguments must be a JSON object, not array"),
        (("broken", {"kind": "refuse"}), "error: refused on purpose"),
        (("broken", {"kind": "bug"}), "error: broken failed: KeyError: 'missing'"),
    ],
)
def test_bad_calls_are_answered_as_errors(call: tuple[str, Any], error: str) -> None:
    """Bugs caught: an exception out of step (one bad call would end the batch), a tool run with
    arguments that do not fit it (a bool taken for an int), an error not counted, or one whose message
    does not start with "error: "."""
    env = Toolbox()
    reply = env.step(_calls(("echo", {"text": "ok"}), call))
    assert [m["content"] for m in reply.messages] == ["ok", error]
    assert (reply.tool_errors, reply.timeouts, reply.done) == (1, 0, False)
    assert env.ran == [("echo", {"text": "ok"})]  # the bad call ran nothing


def test_calls_that_could_not_be_parsed_are_answered_after_the_others() -> None:
    """Bug caught: call_errors ignored (the model never learns its JSON was bad) or taken for an answer."""
    env = Toolbox()
    turn = ModelTurn(
        text="...", content="", tool_calls=(ToolCall("echo", {"text": "ok"}),), call_errors=("bad JSON at 12",)
    )
    reply = env.step(turn)
    assert reply.messages == [
        {"role": "tool", "name": "echo", "content": "ok"},
        {"role": "tool", "content": "error: bad JSON at 12"},
    ]
    assert (reply.tool_errors, reply.done) == (1, False)
    only_errors = env.step(ModelTurn(text="...", content="", call_errors=("no name",)))
    assert (only_errors.done, only_errors.tool_errors, env.answer) == (False, 1, None)


def test_a_timed_out_tool_counts_as_an_error_and_a_timeout() -> None:
    """Bug caught: time-outs not reported to the trainer."""
    reply = Toolbox().step(_calls(("broken", {"kind": "slow"})))
    assert (reply.tool_errors, reply.timeouts) == (1, 1)
    assert reply.messages[0]["content"] == "error: stopped: time limit of 1 s"


def test_the_final_answer_ends_the_episode() -> None:
    """Bugs caught: the answer not kept, the episode left running, a second step allowed after the end."""
    env = Toolbox()
    env.step(_calls(("echo", {"text": "x"})))
    reply = env.step(_answer("42"))
    assert (reply.done, reply.messages, env.answer) == (True, (), "42")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(_answer("43"))


def test_a_cut_turn_ends_the_episode_without_an_answer() -> None:
    """Bug caught: a turn cut by the token limit taken as the final answer (or its calls run)."""
    env = Toolbox()
    turn = ModelTurn(text="4", content="4", tool_calls=(ToolCall("echo", {"text": "x"}),), finished=False)
    assert env.step(turn).done and env.answer is None and env.ran == []


@pytest.mark.parametrize(
    ("answer", "reference", "reward"),
    [
        ("56088", "56088", 1.0),
        (" 56088\n", "56088", 1.0),
        ("56088.0", "56088", 1.0),
        ("1e3", "1000", 1.0),
        ("Paris", " Paris ", 1.0),
        ("56089", "56088", 0.0),
        ("The answer is 56088.", "56088", 0.0),
        ("12345678901234567891", "12345678901234567890", 0.0),  # equal as floats
        ("nan", "nan", 1.0),  # the same text
        ("NaN", "nan", 0.0),
        (None, "56088", 0.0),
    ],
)
def test_reference_match(answer: str | None, reference: str, reward: float) -> None:
    """Bugs caught: no number comparison ("56088.0" refused), comparison through floats (two long
    integers that differ in a last digit matched), white space counted, no answer scored."""
    assert reference_match(answer, reference) == reward


def _episode(env: ToolEnvironment, record: Mapping[str, Any], *turns: ModelTurn) -> float:
    env.start(record)
    for turn in turns:
        if env.step(turn).done:
            break
    return env.reward()


def test_calculator_episodes() -> None:
    """End to end, as the trainer calls it. Bugs caught: the tool not offered or answering the wrong
    value, the reward not the reference match (right, wrong, no answer)."""
    record = {"prompt": "What is 123 * 456?", "answer": "56088"}
    env = Calculator(system_prompt="Use the calculator.")
    start = env.start(record)
    assert start.messages == [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 123 * 456?"},
    ]
    assert [tool["function"]["name"] for tool in start.tools] == ["calculator"]
    reply = env.step(_calls(("calculator", {"expression": "123 * 456"}), ("calculator", {"expression": "os.x"})))
    assert [m["content"] for m in reply.messages] == [
        "56088",
        "error: an attribute is not allowed (os.x): only numbers, + - * / // % ** and parentheses are",
    ]
    assert reply.tool_errors == 1
    assert env.step(_answer("56088.0")).done and env.reward() == 1.0
    assert _episode(Calculator(), record, _answer("56089")) == 0.0
    assert _episode(Calculator(), {"prompt": "?", "answer": 7}, _answer("7")) == 1.0  # a numeric reference
    cut = ModelTurn(text="560", content="560", finished=False)
    assert _episode(Calculator(), record, cut) == 0.0


def test_without_tools_every_call_is_an_error() -> None:
    """Bug caught: offer_tools=False ignored (a tool still offered or still run)."""
    env = Calculator(offer_tools=False)
    assert env.start({"prompt": "1+1?", "answer": "2"}).tools == []
    reply = env.step(_calls(("calculator", {"expression": "1+1"})))
    assert [m["content"] for m in reply.messages] == ["error: no tools are offered in this episode"]
    assert reply.tool_errors == 1


def test_records_without_what_the_environment_needs_are_refused() -> None:
    """Bugs caught: a record without its reference answer started anyway (every reward 0, silently),
    and a message that does not say which field is missing and which fields the record has."""
    with pytest.raises(RecordError, match=r"'answer'.*no such field.*the record's fields: prompt, solution"):
        Calculator().start({"prompt": "1+1?", "solution": "2"})
    with pytest.raises(RecordError, match=r"'answer'.*found str ' '"):
        Calculator().start({"prompt": "1+1?", "answer": " "})
    with pytest.raises(RecordError, match=r"'prompt'.*no such field.*the record's fields: question, answer"):
        Calculator().start({"question": "1+1?", "answer": "2"})
    with pytest.raises(RecordError, match="system message"):
        Calculator(system_prompt="be brief").start(
            {"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "answer": "1"}
        )
    env = Calculator(prompt_field="question", answer_field="solution")
    messages = [{"role": "user", "content": "1+1?"}]
    assert env.start({"question": messages, "solution": "2"}).messages == messages


def test_python_env_runs_code_in_the_sandbox() -> None:
    """End to end through the sandbox (short runs). Bugs caught: the program's output not answered, a
    failing program not counted as an error, a time-out not counted as one."""
    env = PythonEnv(timeout=1.0)
    assert [tool["function"]["name"] for tool in env.start({"prompt": "?", "answer": "56088"}).tools] == ["python"]
    reply = env.step(
        _calls(
            ("python", {"code": "print(123 * 456)"}),
            ("python", {"code": "raise SystemExit(3)"}),
            ("python", {"code": "while True: pass"}),
        )
    )
    contents = [m["content"] for m in reply.messages]
    assert contents[0] == "56088\nexit status: 0"
    assert contents[1] == "error: exit status: 3"
    assert contents[2].startswith("error: exit status: killed by SIGKILL\nstopped: time limit of 1 s")
    assert (reply.tool_errors, reply.timeouts) == (2, 1)
    assert env.step(_answer("56088")).done and env.reward() == 1.0
    with pytest.raises(ValueError, match="wall_seconds=0"):
        PythonEnv(timeout=0)
