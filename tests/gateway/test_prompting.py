import json

import pytest

from tests.extras import skip_without

skip_without("local")

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gateway.prompting import encode_prompt, render_prompt, template_supports_tools, tool_signature, tools_prompt

# SmolLM2-Instruct's template, verbatim: it has no notion of tools.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A minimal template that renders tools and calls itself.
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}:{{ c.function.arguments | tojson }}{% endfor %}"
    "\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _tokenizer(template: str) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "hi", "there"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = template
    return tok


@pytest.fixture
def smol() -> PreTrainedTokenizerFast:
    return _tokenizer(SMOL_TEMPLATE)


def test_plain_conversation_matches_the_template(smol: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(smol, messages) == smol.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True)


def test_tool_support_is_detected_from_the_template(smol: PreTrainedTokenizerFast) -> None:
    assert not template_supports_tools(smol)
    assert template_supports_tools(_tokenizer(NATIVE_TEMPLATE))


def test_tools_go_into_a_new_system_prompt_when_the_template_ignores_them(smol) -> None:
    text = render_prompt(smol, [{"role": "user", "content": "hi"}], TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0], sort_keys=True) + "\n</tools>" in system
    assert "<tool_call>" in system and "SmolLM" not in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tools_are_appended_to_an_existing_system_prompt(smol) -> None:
    text = render_prompt(smol, [{"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": "hi"}], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.count("<|im_start|>system") == 1


def test_calls_and_results_render_as_hermes_text(smol) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    ]
    text = render_prompt(smol, messages, TOOLS)
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n"
            "</tool_call><|im_end|>") in text
    # Both results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text


def test_assistant_prose_before_calls_is_kept(smol) -> None:
    text = render_prompt(smol, [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ], add_generation_prompt=False)
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>" in text
    assert not text.endswith("<|im_start|>assistant\n")


def test_native_templates_receive_the_tools_and_parsed_arguments() -> None:
    native = _tokenizer(NATIVE_TEMPLATE)
    text = render_prompt(native, [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    ], TOOLS)
    assert text.startswith("TOOLS:") and "get_weather" in text
    assert 'CALL:f:{"a": 1}' in text  # arguments reach the template as an object, not a string
    assert "[assistant]CALL" in text and "None" not in text  # None content became an empty string


def test_encode_prompt_adds_no_special_tokens_of_its_own(smol) -> None:
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": "there"}]
    ids = encode_prompt(smol, messages)
    assert ids == smol(render_prompt(smol, messages), add_special_tokens=False)["input_ids"]
    assert ids[0] == smol.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]


def _reordered(value):  # noqa: ANN001, ANN202 - every object's keys in reverse order, lists as they are
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


NESTED = {"type": "function", "function": {
    "name": "book_trip", "description": "Book a trip for a traveller. Charges the card on file. e.g. never twice.",
    "parameters": {"type": "object", "required": ["city", "dates"], "properties": {
        "city": {"type": "string", "description": "where to"},
        "dates": {"type": "object", "required": ["start"], "properties": {
            "start": {"type": "string"}, "nights": {"type": "integer"}}},
        "class": {"type": "string", "enum": ["economy", "business"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "budget": {"type": ["number", "null"]},
        "seats": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"const": "any"}]}}}}}}


@pytest.mark.parametrize("rendering", ["hermes", "compact"])
def test_a_tool_spec_renders_the_same_whatever_the_order_of_its_keys(smol, rendering: str) -> None:
    # The store keeps JSON with sorted keys; a spec read back must render as it was served.
    messages = [{"role": "user", "content": "hi"}]
    served = render_prompt(smol, messages, [NESTED, *TOOLS], rendering=rendering)
    assert served == render_prompt(smol, messages, _reordered([NESTED, *TOOLS]), rendering=rendering)
    assert served == render_prompt(smol, messages, json.loads(json.dumps([NESTED, *TOOLS], sort_keys=True)),
                                   rendering=rendering)


def test_the_compact_rendering_writes_a_signature_per_tool() -> None:
    assert tool_signature(TOOLS[0]["function"]) == "get_weather(city: string): Current weather for a city"
    assert tool_signature(NESTED["function"]) == (
        'book_trip(city: string, dates: {start: string, nights?: integer}, budget?: number|null, '
        'class?: "economy"|"business", seats?: (integer|"any")[], tags?: string[]): Book a trip for a traveller.')
    assert tool_signature({"name": "ping"}) == "ping()"
    block = tools_prompt([NESTED, *TOOLS], "compact")
    assert block.startswith("# Tools\n") and "<tool_call>" in block
    assert block.count("\n" + "book_trip(") == 1 and block.count("\n" + "get_weather(") == 1


def test_the_compact_rendering_takes_a_quarter_of_the_tokens_per_suite_tool(smol_tokenizer, tmp_path) -> None:  # noqa: ANN001
    from training.tasks import get_suite

    tools = get_suite("tools", data_dir=tmp_path).registry().openai_tools()
    builtin = [t for t in tools if t["function"]["name"] in ("calculator", "sql_query", "convert_units")]
    assert len(tools) >= 27 and len(builtin) == 3

    def per_tool(rendering: str, chosen: list[dict]) -> float:
        def count(block: str) -> int:
            return len(smol_tokenizer(block, add_special_tokens=False)["input_ids"])
        return (count(tools_prompt(chosen, rendering)) - count(tools_prompt([], rendering))) / len(chosen)

    # The generated tools carry enums, arrays of them and nested objects, which the compact line spells out: 40.3
    # tokens a tool over the whole suite against 156.1, and 27.7 against 150.3 for the three built-in ones.
    compact, hermes = per_tool("compact", tools), per_tool("hermes", tools)
    assert compact <= 42 and hermes >= 3.5 * compact
    assert per_tool("compact", builtin) <= 30 and per_tool("hermes", builtin) >= 5 * per_tool("compact", builtin)
