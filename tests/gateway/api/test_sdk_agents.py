"""Client-side agents with their own tools, through the gateway: the OpenAI Agents SDK (over chat
completions and over the Responses API) and LangChain's ``bind_tools``. The model is a scripted stand-in
that calls the client's tool, then answers from its result."""

from pathlib import Path

import pytest

from tests.gateway.api.support import serve

pytestmark = pytest.mark.integration


def _weather_call(body: dict) -> dict:
    """Call the client's weather tool by whatever name it was offered under."""
    [tool] = [t for t in body["tools"] if "weather" in t["function"]["name"]]
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_w1", "type": "function", "function": {"name": tool["function"]["name"],
                                                          "arguments": '{"city": "Paris"}'}}]}


def _answer(body: dict) -> str:
    result = next(m for m in reversed(body["messages"]) if m["role"] == "tool")
    return f"The tool said: {result['content']}"


@pytest.mark.parametrize("surface", ["chat", "responses"])
async def test_openai_agents_sdk_runs_its_own_tool(tmp_path: Path, surface: str) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        ran.append(city)
        return f"21 C and sunny in {city}"

    for served in serve(tmp_path, [_weather_call, _answer]):
        client = AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        model = (OpenAIChatCompletionsModel if surface == "chat" else OpenAIResponsesModel)(
            model="scripted-model", openai_client=client)
        agent = Agent(name="weather", instructions="Use the tool.", model=model, tools=[get_weather])
        result = await Runner.run(agent, "Weather in Paris?")
        assert ran == ["Paris"]
        assert result.final_output == "The tool said: 21 C and sunny in Paris"
        # the second model call carried the tool's result, paired with its call
        sent = served.backend.requests[1]["messages"]
        assert sent[-1]["role"] == "tool" and sent[-1]["tool_call_id"] == "call_w1"
        await client.close()


def test_langchain_bind_tools(tmp_path: Path) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return f"21 C in {city}"

    for served in serve(tmp_path, [_weather_call, _weather_call, _answer]):
        llm = ChatOpenAI(base_url=served.url + "/v1", api_key="unused", model="scripted-model",
                         max_retries=0).bind_tools([get_weather])
        reply = llm.invoke([HumanMessage("Weather in Paris?")])
        assert reply.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_w1",
                                     "type": "tool_call"}]
        streamed = None
        for chunk in llm.stream([HumanMessage("Weather in Paris?")]):
            streamed = chunk if streamed is None else streamed + chunk
        assert streamed.tool_calls[0]["args"] == {"city": "Paris"}
        final = llm.invoke([HumanMessage("Weather in Paris?"), reply,
                            ToolMessage(get_weather.invoke({"city": "Paris"}), tool_call_id="call_w1")])
        assert final.content == "The tool said: 21 C in Paris"
