"""OpenAI tool calling for the endpoint (:mod:`marft.serving.serve`), in the convention most open models are
trained on (Hermes, Qwen2.5): the model is shown the functions' JSON signatures, calls one by writing
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` and reads the result in a
``<tool_response>`` block. A request's structured-output ``response_format`` is asked for the same
way, as an instruction in the system message (the schema shown, not enforced).

A chat template that renders ``tools`` itself (a model trained on tool use ships one) is given the
tools and the messages as transformers' templates take them (:class:`Chat`); for one that does not,
the tools and the tool turns are written into the messages as text (:func:`chat`). Either way the
engine renders and tokenizes the result as any chat, so the prompt ids it records are the ones the
model was given.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Callable


class Chat(list):
    """A chat's messages and the tools its chat template is to show: ``marft.engines.generation.render_chat``
    passes them as ``apply_chat_template(..., tools=)``. A list, so that the engines hand it on as
    any chat."""

    def __init__(self, messages: list[dict], tools: list[dict]):
        super().__init__(messages)
        self.tools = tools


def template_shows_tools(tok) -> bool:
    """Whether ``tok``'s chat template renders tools itself (it reads a ``tools`` variable)."""
    template = tok.chat_template
    return isinstance(template, str) and "tools" in template


def chat(messages: list[dict], tools: list[dict] | None, tok, response_format: dict | None = None) -> list[dict]:
    """What the engine renders for ``messages`` (as :func:`marft.serving.serve._messages` gives them) with
    ``tools`` shown (None: none) and a structured-output ``response_format`` (json_object or
    json_schema) asked for in the system message: ``messages`` themselves when nothing in them is
    about tools or formats, so that such a chat renders exactly as before."""
    if response_format:  # an instruction only: sampling is not constrained (marft.serving.serve says so once)
        schema = response_format["json_schema"].get("schema") if response_format["type"] == "json_schema" else None
        messages = _with_system(messages, "Reply with one JSON object and nothing else" + (
            ", matching this JSON schema:\n" + json.dumps(schema, ensure_ascii=False) if schema else "."))
    if template_shows_tools(tok):
        return Chat(messages, tools) if tools else messages
    if not tools and all(m["role"] != "tool" and "tool_calls" not in m for m in messages):
        return messages
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # the results of one turn's calls: one user turn
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result})
        elif "tool_calls" in m:
            calls = [_block({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        else:
            out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        paragraph = ("# Tools\n\nYou may call the functions whose signatures are listed in <tools></tools>:\n"
                     f"<tools>\n{listing}\n</tools>\n\nTo call one, write a JSON object with its name and arguments "
                     "in <tool_call></tool_call> tags, one block per call:\n<tool_call>\n"
                     '{"name": <function name>, "arguments": <its arguments as a JSON object>}\n</tool_call>')
        out = _with_system(out, paragraph)
    return out


def _with_system(messages: list[dict], paragraph: str) -> list[dict]:
    """``messages`` with ``paragraph`` ending the system message (a new one first if there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + paragraph}] + messages[1:]
    return [{"role": "system", "content": paragraph}] + messages


def _block(call: dict) -> str:
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse(text: str, names: set[str], ids: Callable[[int], str] | None = None) -> tuple[str | None, list[dict]]:
    """A reply's content and tool calls as OpenAI sends them back: each ``<tool_call>`` block holding
    a JSON object that names a function of ``names`` (its arguments a JSON object, or none) becomes a
    call, and the rest of the text, stripped, the content (None when empty). Any other block stays in
    the content as text (the program sees what the model wrote); without a call, the content is
    ``text`` as it is. ``ids(k)`` names the k-th call (default: ``call_`` and 24 random hex digits)."""
    calls = []

    def take(block: re.Match) -> str:
        try:
            call = json.loads(block.group(1))
        except ValueError:
            return block.group(0)
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"] in names
                and isinstance(call.get("arguments", {}), dict)):
            return block.group(0)
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append({"id": ids(len(calls)) if ids is not None else "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
        return ""

    rest = _CALL.sub(take, text).strip()
    return (rest or None, calls) if calls else (text, [])
