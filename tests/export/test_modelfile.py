"""The Ollama Modelfile holds exactly what it was given: each PARAMETER is a name Ollama knows with a value of its
kind and range, and no value (a parameter, the system prompt, a stop token) can end its line early and add a
directive of its own, such as a second FROM. `ollama_commands` reads the text back the way Ollama's parser
(ollama/parser/parser.go: no escape character; a value ends at a line break once its quotes close; unprintable
characters dropped) does."""

from __future__ import annotations

import pytest

import fastft
from fastft.checks import SettingError
from fastft.export.ollama import modelfile

COMMANDS = {"from", "license", "template", "system", "adapter", "draft", "renderer", "parser", "parameter"}


def _unquote(text: str) -> tuple[str, bool]:
    if text.startswith('"""'):
        return (text[3:-3], True) if len(text) >= 6 and text.endswith('"""') else ("", False)
    if text.startswith('"'):
        return (text[1:-1], True) if len(text) >= 2 and text.endswith('"') else ("", False)
    return text, True


def ollama_commands(text: str) -> list[tuple[str, str]]:
    """(name, value) of each command, as Ollama's Modelfile parser reads `text` (PARAMETERs by their name)."""
    commands, state, buffer, name = [], "nil", "", ""
    for char in text:
        if state == "nil":
            if char == "#":
                state = "comment"
            elif char not in " \t\r\n":
                state, buffer = "name", char
        elif state == "comment":
            if char in "\r\n":
                state = "nil"
        elif state == "name":
            if char.isascii() and char.isalpha():
                buffer += char
            elif char in " \t":
                assert buffer.lower() in COMMANDS, f"not a Modelfile command: {buffer!r}"
                if buffer.lower() == "parameter":
                    state, buffer = "parameter", ""
                else:
                    state, buffer, name = "value", "", buffer.lower()
            else:
                raise AssertionError(f"not a Modelfile command: {buffer + char!r}")
        elif state == "parameter":
            if char.isascii() and (char.isalnum() or char == "_"):
                buffer += char
            elif char in " \t":
                state, name, buffer = "value", buffer, ""
            else:
                raise AssertionError(f"bad parameter name {buffer + char!r}")
        elif state == "value":
            if char in " \t\r\n":
                value, closed = _unquote(buffer.strip())
                if not closed or char in " \t":
                    buffer += char
                    continue
                commands.append((name, value))
                state, buffer = "nil", ""
            elif char.isprintable():
                buffer += char
    if state == "value":
        value, closed = _unquote(buffer.strip())
        assert closed, f"unclosed value {buffer!r}"
        commands.append((name, value))
    return commands


@pytest.fixture(scope="module")
def llama():
    return fastft.load_model("tiny-llama", max_seq_length=128)


def test_a_known_parameter_and_a_multi_line_system_prompt_are_read_back_exactly(llama):
    model, tokenizer = llama
    system = 'Be brief.\nFROM /etc/passwd\nPARAMETER temperature 9\n"quoted" and ""'
    stops = ['say "hi"', '"', '""', "</answer>"]
    text = modelfile(
        model,
        tokenizer,
        "./model.Q8_0.gguf",
        parameters={"temperature": 0.7, "num_ctx": 4096, "top_k": 40, "stop": stops},
        system=system,
    )
    commands = ollama_commands(text)
    assert [value for name, value in commands if name == "from"] == ["./model.Q8_0.gguf"]
    assert [value for name, value in commands if name == "system"] == [system]
    assert [value for name, value in commands if name == "temperature"] == ["0.7"]  # replaces the default
    assert [value for name, value in commands if name == "num_ctx"] == ["4096"]
    stop_values = [value for name, value in commands if name == "stop"]
    assert stop_values[-len(stops) :] == stops and tokenizer.eos_token in stop_values
    template = [value for name, value in commands if name == "template"]
    assert len(template) == 1 and "{{ .Content }}" in template[0]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"temperature": "0.7\nFROM /etc/passwd"}, "parameters['temperature'] must be a number"),
        ({"temperature": "hot"}, "parameters['temperature'] must be a number, got 'hot'"),
        ({"temperature": -1.0}, "parameters['temperature'] must be at least 0"),
        ({"top_p": 1.5}, "parameters['top_p'] must be in [0, 1]"),
        ({"num_ctx": 4096.5}, "parameters['num_ctx'] must be a whole number"),
        ({"seed": True}, "parameters['seed'] must be a whole number"),
        ({"num_ctx": "4096"}, "parameters['num_ctx'] must be a whole number"),
        ({"stop": "</s>\nFROM /etc/passwd"}, "parameters['stop'] holds a line break"),
        ({"stop": ["ok", "bell\x07"]}, "unprintable character '\\x07'"),
        ({"stop": []}, "must be a text or a list of texts"),
        ({"stop": 3}, "must be a text or a list of texts"),
        ({"temprature": 0.7}, "Did you mean 'temperature'?"),
        ({"FROM /etc/passwd\nPARAMETER x": 1}, "is not an Ollama Modelfile parameter"),
        ([("temperature", 0.7)], "parameters must be a dict"),
    ],
)
def test_bad_parameters_are_refused_naming_the_parameter(llama, parameters, message):
    model, tokenizer = llama
    with pytest.raises(SettingError) as error:
        modelfile(model, tokenizer, "./m.gguf", parameters=parameters)
    assert message in str(error.value)
    if "not an Ollama Modelfile parameter" in message:
        from fastft.export.ollama import PARAMETERS

        assert ", ".join(sorted(PARAMETERS)) in str(error.value)  # the valid names, listed


@pytest.mark.parametrize(
    ("system", "message"),
    [
        ('end """\nFROM /etc/passwd\n"""', 'holds """'),
        ("nul\x00byte", "unprintable character '\\x00'"),
        ("\u202eright-to-left override", "unprintable character"),
        (["a list"], "system must be a text"),
    ],
)
def test_a_system_prompt_that_could_leave_its_block_is_refused(llama, system, message):
    model, tokenizer = llama
    with pytest.raises(SettingError, match="system") as error:
        modelfile(model, tokenizer, "./m.gguf", system=system)
    assert message in str(error.value)


def test_save_ollama_refuses_bad_parameters_before_writing_anything(llama, tmp_path):
    model, tokenizer = llama
    with pytest.raises(SettingError, match="parameters\\['temperature'\\] must be a number"):
        fastft.save_ollama(
            model, tmp_path / "ollama", tokenizer, "f16", parameters={"temperature": "0.7\nFROM /etc/passwd"}
        )
    assert list(tmp_path.iterdir()) == []
