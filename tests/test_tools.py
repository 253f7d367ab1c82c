"""Tool calls: the plans of ``tools`` and ``tool_choice``, and calls read back from replies as Hermes/Qwen2.5 and
Llama 3.x write them (the server's end to end: tests/test_server.py)."""

import json

import jsonschema
import pytest

from kvgen.serving.tools import ToolError, ToolPlan, template_messages

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}


def test_auto_reads_tagged_and_llama_style_calls_of_offered_tools_only():
    plan = ToolPlan.of([WEATHER, TIME], "auto", parallel=True)
    assert plan.shown == [WEATHER, TIME] and plan.grammar is None
    content, calls = plan.read('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
                               '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("weather", {"city": "Oslo"}), ("time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    _, (unclosed,) = plan.read('<tool_call>{"name": "time", "arguments": {}}')  # the reply ended at the call
    assert unclosed["function"]["name"] == "time"
    _, (llama,) = plan.read(' {"name": "weather", "parameters": {"city": "Rome", "days": 2}}')
    assert json.loads(llama["function"]["arguments"]) == {"city": "Rome", "days": 2}
    for not_a_call in ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', '{"name": "weather"',
                       "The weather is fine.", '{"city": "Oslo"}'):
        assert plan.read(not_a_call) == (not_a_call, [])


def test_a_stream_holds_back_what_may_be_a_call():
    plan = ToolPlan.of([WEATHER], "auto", parallel=True)
    assert plan.held("It is sunny") == len("It is sunny")
    assert plan.held("It is sunny <tool") == len("It is sunny ")  # the tag may be opening
    assert plan.held('Sure <tool_call>{"name"') == len("Sure ")
    assert plan.held('  {"name": "weather"') == 0  # a Llama-style call
    assert ToolPlan.of([WEATHER], {"type": "function", "function": {"name": "weather"}}, True).held("{") == 0
    none = ToolPlan.of([WEATHER], "none", parallel=True)
    assert none.shown is None and none.held("<tool_call>") == len("<tool_call>")
    assert none.read('<tool_call>{"name": "weather", "arguments": {}}</tool_call>')[1] == []


def test_forced_calls_take_their_grammar_and_read_the_reply_as_arguments():
    named = ToolPlan.of([WEATHER, TIME], {"type": "function", "function": {"name": "weather"}}, parallel=True)
    assert named.forced == "weather" and named.grammar
    content, (call,) = named.read('{"city": "Lima"}')
    assert content is None and call["function"] == {"name": "weather", "arguments": '{"city": "Lima"}'}
    required = ToolPlan.of([WEATHER, TIME], "required", parallel=False)
    _, calls = required.read('[{"name": "time", "arguments": {}}]')
    assert [c["function"]["name"] for c in calls] == ["time"]
    with pytest.raises(ValueError):
        named.read('{"city": ')  # cut short: the server answers it as content


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "retrieval"}], "auto", "tools"),
    ([{"type": "function", "function": {"parameters": {}}}], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "launch"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}], "required", "tools"),
])
def test_tools_that_cannot_be_served_name_the_field(tools, choice, param):
    with pytest.raises(ToolError) as info:
        ToolPlan.of(tools, choice, parallel=True)
    assert info.value.param == param and str(info.value)


def test_an_assistants_call_arguments_reach_the_template_as_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    (message,) = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    jsonschema.validate(message["tool_calls"][0]["function"]["arguments"], WEATHER["function"]["parameters"])
