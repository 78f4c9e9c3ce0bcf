"""Three agent frameworks pointed at the panel as at any OpenAI-compatible server, on a vLLM →
SGLang pair: LangChain's ChatOpenAI
(`bind_tools`, `with_structured_output`), pydantic-ai (an agent with one tool and a typed result)
and the OpenAI Agents SDK (an agent that must call its tool, then answers; through Chat
Completions and through the Responses API). Pinned in the test
dependencies; nothing here reaches outside this machine."""

from __future__ import annotations

import asyncio

import jsonschema
import pytest
from pydantic import BaseModel, Field

from .cluster import pair_name

# What a framework exercises is the panel's OpenAI surface (tool calls, structured outputs, the
# Responses API), whatever the engines; each engine's grammar and tool calls are
# test_api_fields.py's, the Responses API on torch → MLX is test_responses.py's. One route: the one
# that measured cheapest (it ran on torch → MLX too, at twice the time).
ROUTES = [("vllm", "sglang2")]
IDS = [pair_name(*r) for r in ROUTES]
CALLED: list[str] = []


class Weather(BaseModel):
    city: str = Field(max_length=30)
    degrees_celsius: int = Field(ge=-60, le=60)
    raining: bool


def get_weather(city: str) -> str:
    """The current weather in a city."""
    CALLED.append(city)
    return f"12 degrees celsius and light rain in {city}"


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_langchain_binds_tools_and_returns_structured_output(cluster, route):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=pair_name(*route),
        base_url=cluster.panel.url + "/v1",
        api_key=cluster.api_key,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    weather_tool = tool(get_weather)
    message = llm.bind_tools([weather_tool], tool_choice="required").invoke("What is the weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], weather_tool.args_schema.model_json_schema())
    for method in ("json_schema", "function_calling"):  # json_mode: the tiny model may write any JSON
        typed = llm.with_structured_output(Weather, method=method).invoke(
            "Describe the weather in Lima as JSON with city, degrees_celsius and raining."
        )
        assert isinstance(typed, Weather), (method, typed)


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_pydantic_ai_agent_with_a_tool_and_a_typed_result(cluster, route):
    from pydantic_ai import Agent, RunContext, Tool
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    async def until_answered(ctx: RunContext, tool_def):
        """Offered until it has answered once: the embedded model, left the choice, calls it
        again and again (pydantic-ai forces some tool call: its own or the typed result's)."""
        answered = any(
            isinstance(part, ToolReturnPart) and part.tool_name == tool_def.name
            for message in ctx.messages
            for part in getattr(message, "parts", ())
        )
        return None if answered else tool_def

    model = OpenAIChatModel(
        pair_name(*route), provider=OpenAIProvider(base_url=cluster.panel.url + "/v1", api_key=cluster.api_key)
    )
    agent = Agent(
        model,
        output_type=Weather,
        tools=[Tool(get_weather, prepare=until_answered)],
        model_settings=ModelSettings(temperature=0, max_tokens=80),
    )
    CALLED.clear()
    result = agent.run_sync("What is the weather in Oslo? Use the tool, then report it.")
    print(f"\npydantic-ai on {pair_name(*route)}: tool calls {CALLED}, result {result.output!r}")
    assert CALLED and isinstance(result.output, Weather)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_openai_agents_sdk_calls_its_tool_then_answers(cluster, route, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces leave this machine

    async def run():
        client = AsyncOpenAI(base_url=cluster.panel.url + "/v1", api_key=cluster.api_key, max_retries=0)
        model = {"chat_completions": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}[api]
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather.",
            tools=[function_tool(get_weather)],
            model=model(model=pair_name(*route), openai_client=client),
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
        )
        return await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)

    CALLED.clear()
    result = asyncio.run(run())
    print(f"\nAgents SDK ({api}) on {pair_name(*route)}: tool calls {CALLED}, answer {result.final_output!r}")
    assert CALLED == ["Oslo"] and isinstance(result.final_output, str) and result.final_output
