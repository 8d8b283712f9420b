"""OpenAI chat requests -> engine prompts: the chat template rendered with the request's messages
(:class:`ChatRenderer`, reasoning switches included), the tools planned (:class:`ToolPlan`: which
grammar, which format, described how) and a finished turn read back into text, reasoning and
tool calls (:func:`read_turn`). See :mod:`sgrt.server.openai.adapter` for the tool-call format."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sgrt.errors import InvalidRequest
from sgrt.server.openai import protocol as op
from sgrt.server.ws.protocol import ToolSpec
from sgrt.server.turns import formats as tf
from sgrt.server.turns.tools import (
    TOOL_NAME, template_renders_tools, template_tools, tool_results_as_user, tools_system_prompt,
)


# ==== chat prompts and tools ======================================================================


@dataclass
class ToolPlan:
    """How a chat turn uses its tools, its format and its reasoning.

    ``mode`` is ``none``, ``auto``, ``required`` or ``named``; ``specs`` are the tools offered
    and ``chosen`` those the grammar allows (the named one for ``named``); ``parallel``: one or
    more calls per turn rather than one (``parallel_tool_calls``; unset: true with several
    tools, false with one). ``fmt`` is the family's tool-call format and
    ``think`` where the turn starts relative to a ``<think>`` block (``open``, ``inside`` or
    None; set by :meth:`ChatRenderer.render`). ``grammar`` (from :meth:`finish`) constrains the
    turn; ``answer_schema`` is a ``response_format`` folded into that grammar.
    """

    specs: list[ToolSpec] = field(default_factory=list)
    mode: str = "none"
    chosen: list[ToolSpec] = field(default_factory=list)
    parallel: bool = True
    fmt: tf.ToolFormat = tf.GENERIC
    think: str | None = None
    thinking_enabled: bool | None = None
    grammar: str | None = None
    answer_schema: dict[str, Any] | None = None
    trigger_token: int | None = None
    #: with ``mode="none"`` and tools in a format whose calls start with ``{``: constrain the
    #: text not to start with ``{`` (WebSocket sessions, so that a small model cannot imitate a
    #: call it saw earlier in the conversation).
    guard_none: bool = False

    @property
    def may_call(self) -> bool:
        return self.mode != "none" and bool(self.specs)

    def finish(self, fields: dict[str, Any]) -> None:
        """Set ``grammar`` from the plan and put it into the engine ``fields`` (replacing a
        ``json_schema`` constraint when a think block must come before the answer)."""
        if self.think is not None and "json_schema" in fields:
            from sgrt.constrained import GrammarOptions, normalize_schema

            from sgrt.constrained.llguidance_backend import json_options

            schema = fields.pop("json_schema")
            # NOTE: the JSON layout of a plain json_schema request (no free whitespace), which
            # %json inside a Lark grammar does not get by default: a model could otherwise
            # write whitespace until max_tokens after </think>.
            options = GrammarOptions()
            self.answer_schema = {**normalize_schema(schema, options).schema, "x-guidance": json_options(options)}
        if self.think is not None and any(k in fields for k in ("regex", "grammar")):
            self.think = None  # a raw regex / grammar constrains the whole turn, as asked
        if self.may_call or self.answer_schema is not None or (self.think and self.mode != "none"):
            self.grammar = tf.turn_grammar(self.chosen, mode=self.mode if self.may_call else "none",
                                           parallel=self.parallel, fmt=self.fmt, think=self.think,
                                           answer_schema=self.answer_schema, trigger_token=self.trigger_token)
        elif (self.guard_none and self.specs and self.mode == "none" and self.think is None
              and not self.fmt.trigger and not any(k in fields for k in ("regex", "grammar", "json_schema"))):
            self.grammar = TEXT_ONLY_GRAMMAR
        if self.grammar is not None:
            fields["grammar"] = self.grammar
        if self.fmt.trigger and self.may_call:
            fields["skip_special_tokens"] = False  # the trigger may be a special token


#: Free text that does not start with ``{`` (``tool_choice="none"`` in a WebSocket session).
TEXT_ONLY_GRAMMAR = "start: TEXT\nTEXT: /[^{](.|\\n)*/\n"


def plan_choice(specs: list[ToolSpec], choice: str, parallel: bool | None, fmt: tf.ToolFormat = tf.GENERIC) -> ToolPlan:
    """The plan of a turn over checked tool ``specs`` and a string ``choice``: ``"auto"``,
    ``"required"``, ``"none"`` or a tool's name (the WebSocket protocol's ``tool_choice``).
    ``parallel`` None: several calls allowed when there are several tools.

    Raises:
        InvalidRequest: (field ``tool_choice``) a name that is not one of ``specs``.
    """
    par = parallel if parallel is not None else len(specs) > 1
    if not specs or choice == "none":
        return ToolPlan(specs=list(specs), mode="none", fmt=fmt, parallel=par)
    if choice in ("auto", "required"):
        return ToolPlan(specs=list(specs), mode=choice, chosen=list(specs), parallel=par, fmt=fmt)
    chosen = [s for s in specs if s.name == choice]
    if not chosen:
        raise InvalidRequest(f"tool_choice must be auto, required, none or a tool name, got {choice!r}",
                             field="tool_choice")
    return ToolPlan(specs=list(specs), mode="named", chosen=chosen, parallel=False, fmt=fmt)


def plan_tools(req: Any, max_tools: int, fmt: tf.ToolFormat = tf.GENERIC) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and plan the turn.

    ``req`` has the chat request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    constraint fields (the Responses and Messages APIs translate to it).

    Raises:
        InvalidRequest: a bad tool (``tools[i]...``), an unknown named tool, a bad
            ``tool_choice``, or tools combined with another constraint.
    """
    tools = req.tools or []
    choice = req.tool_choice
    # NOTE: unset means parallel when there are several tools (as the issue asks), one call with
    # a single tool: a small model asked for one tool's call otherwise tends to repeat it.
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else len(tools) > 1
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", field="tool_choice")
        return ToolPlan(fmt=fmt, parallel=parallel)
    if len(tools) > max_tools:
        raise InvalidRequest(f"{len(tools)} tools exceed the server's limit ({max_tools})", field="tools")
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequest(f"tools[{i}].type must be 'function', got {tool.type!r}", field=f"tools[{i}].type")
        fn = tool.function
        if not TOOL_NAME.match(fn.name):
            raise InvalidRequest(f"tool name {fn.name!r} must match {TOOL_NAME.pattern}",
                                 field=f"tools[{i}].function.name")
        if fn.name in seen:
            raise InvalidRequest(f"duplicate tool name {fn.name!r}", field=f"tools[{i}].function.name")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidRequest("tool parameters must be an object schema",
                                 field=f"tools[{i}].function.parameters")
        specs.append(ToolSpec(name=fn.name, description=fn.description or "", parameters=params))
    if choice is None or choice == "auto":
        mode, chosen = "auto", specs
    elif choice == "none":
        return ToolPlan(specs=specs, mode="none", fmt=fmt, parallel=parallel)
    elif choice == "required":
        mode, chosen = "required", specs
    elif isinstance(choice, op.NamedToolChoice):
        chosen = [s for s in specs if s.name == choice.function.name]
        if not chosen:
            raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                 field="tool_choice.function.name")
        mode = "named"
    else:
        raise InvalidRequest(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                             field="tool_choice")
    for name in ("regex", "json_schema", "grammar", "response_format"):
        value = getattr(req, name, None)
        if value is not None and not (name == "response_format" and value.type == "text"):
            raise InvalidRequest(f"{name} cannot be combined with tools (unless tool_choice is 'none')",
                                 field=name)
    # NOTE: a named tool_choice forces one call of that function (what structured-output
    # clients read back as tool_calls[0]); parallel calls are for auto / required.
    return ToolPlan(specs=specs, mode=mode, chosen=chosen, parallel=parallel and mode != "named", fmt=fmt)


def calls_only_grammar(specs: list[ToolSpec]) -> str:
    """Lark grammar (llguidance syntax) of exactly one call of one of ``specs`` (generic format)."""
    return tf.turn_grammar(specs, mode="required", parallel=False) or ""


def format_calls(fmt: tf.ToolFormat, calls: list[tuple[str, Any]]) -> str:
    """``calls`` (name, arguments object) as the text ``fmt`` writes them (the history of a
    template that does not render ``tool_calls`` itself)."""
    args_key = fmt.args_key
    bodies = [fmt.call_open + json.dumps({"name": n, args_key: a}) + fmt.call_close for n, a in calls]
    return fmt.list_open + fmt.separator.join(bodies) + fmt.list_close


REASONING_OFF = ("none", "minimal")


class ChatRenderer:
    """Renders ``messages`` (+ tools) with the model's chat template.

    Tools go through ``tools=`` when the template renders them, else into the system prompt.
    Assistant tool calls go as ``tool_calls`` to a template in a known family's format, else as
    their text in the family's (or the generic) format; ``tool`` messages as the ``tool`` role,
    or as a user message when the template refuses that role. ``traits`` (detected from the
    template: :func:`sgrt.server.turns.formats.detect_traits`) give the tool-call format and the
    reasoning switch; they can be replaced (tests, an operator forcing a format).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._renders_tools: bool | None = None
        template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
        self.traits = tf.detect_traits(template if isinstance(template, str) else None)

    def renders_tools(self) -> bool:
        if self._renders_tools is None:
            self._renders_tools = template_renders_tools(self.tokenizer)
        return self._renders_tools

    def messages(self, msgs: list[op.ChatMessage], fmt: tf.ToolFormat | None = None) -> list[dict[str, Any]]:
        """Plain dict messages for the template.

        Raises:
            InvalidRequest: an unknown role or content part (``messages[i]...``).
        """
        fmt = fmt or self.traits.tool_format
        structured = fmt.native and self.renders_tools()
        if not msgs:
            raise InvalidRequest("messages must not be empty", field="messages")
        call_names: dict[str, str] = {}
        out: list[dict[str, Any]] = []
        for i, m in enumerate(msgs):
            text = _content_text(m.content, i)
            role = m.role
            if role == "developer":
                role = "system"
            if role in ("system", "user"):
                out.append({"role": role, "content": text})
            elif role == "assistant":
                calls = []
                for j, call in enumerate(m.tool_calls or []):
                    try:
                        args = json.loads(call.function.arguments or "{}")
                    except ValueError:
                        raise InvalidRequest("tool call arguments must be JSON text",
                                             field=f"messages[{i}].tool_calls[{j}].function.arguments") from None
                    if call.id:
                        call_names[call.id] = call.function.name
                    calls.append((call.function.name, args, call.id))
                if calls and structured:
                    out.append({"role": "assistant", "content": text, "tool_calls": [
                        {"id": cid or f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}}
                        for k, (n, a, cid) in enumerate(calls)]})
                    continue
                if calls:
                    text = "\n".join(([text] if text else []) + [format_calls(fmt, [(n, a) for n, a, _ in calls])])
                out.append({"role": "assistant", "content": text})
            elif role == "tool":
                name = call_names.get(m.tool_call_id or "", m.name or "tool")
                msg = {"role": "tool", "name": name, "content": text}
                if m.tool_call_id:
                    msg["tool_call_id"] = m.tool_call_id
                out.append(msg)
            else:
                raise InvalidRequest(
                    f"role must be system, developer, user, assistant or tool, got {m.role!r}",
                    field=f"messages[{i}].role")
        return out

    def template_kwargs(self, plan: ToolPlan, reasoning_effort: str | None) -> dict[str, Any]:
        """Extra template variables: the thinking switch for ``reasoning_effort`` (``none`` /
        ``minimal`` turn thinking off; other values on), where the template has one."""
        switch = self.traits.thinking_switch
        if reasoning_effort is None or switch is None:
            return {}
        plan.thinking_enabled = reasoning_effort not in REASONING_OFF
        return {switch: plan.thinking_enabled}

    def render(self, msgs: list[op.ChatMessage], plan: ToolPlan, reasoning_effort: str | None = None) -> str:
        """The prompt text (generation prompt added); sets ``plan.think``.

        Raises:
            InvalidRequest: (field ``messages``) bad messages, or the template failed on them.
        """
        messages = self.messages(msgs, plan.fmt)
        tools_arg = None
        kwargs = self.template_kwargs(plan, reasoning_effort)
        if plan.specs:
            if self.renders_tools():
                tools_arg = template_tools(plan.specs)
            else:
                # NOTE: the same description whatever parallel_tool_calls says (the grammar
                # enforces it), so that turns of one conversation share their prefix in the cache.
                desc = tools_system_prompt(plan.specs, plan.fmt, parallel=True)
                if messages[0]["role"] == "system":
                    messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{desc}"}
                else:
                    messages.insert(0, {"role": "system", "content": desc})
        try:
            text = self._apply(messages, tools_arg, kwargs)
        except InvalidRequest:
            raise
        except Exception as first:  # noqa: BLE001 - e.g. a template that refuses the "tool" role
            text = None
            if any(m["role"] == "tool" for m in messages):
                as_user = tool_results_as_user(messages)
                try:
                    text = self._apply(as_user, tools_arg, kwargs)
                except Exception:  # noqa: BLE001
                    pass
            if text is None:
                raise InvalidRequest(f"the chat template failed on these messages: {first}",
                                     field="messages") from None
        plan.think = think_mode(text) if self.traits.thinking else None
        plan.trigger_token = self.special_token_id(plan.fmt.trigger)
        return text

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token of this vocabulary (else None)."""
        if not text:
            return None
        special = getattr(getattr(self.tokenizer, "hf", None), "all_special_ids", None) or []
        try:
            ids = self.tokenizer.encode(text)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it has no such token
            return None
        return ids[0] if len(ids) == 1 and ids[0] in special else None

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict] | None, kwargs: dict[str, Any]) -> str:
        if tools is None:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs)


def think_mode(prompt: str) -> str | None:
    """Where a thinking model's turn starts: ``inside`` when the generation prompt opened a
    ``<think>`` block, None when it wrote an empty closed one (thinking switched off), else
    ``open`` (the model may write one)."""
    opened, closed = prompt.rfind(tf.THINK_OPEN), prompt.rfind(tf.THINK_CLOSE)
    if opened > closed:
        return "inside"
    if closed >= 0 and not prompt[closed + len(tf.THINK_CLOSE):].strip():
        return None
    return "open"


def _content_text(content: str | list[op.ContentPart] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"only text content parts are supported, got {part.type!r}",
                                 field=f"messages[{i}].content[{j}].type")
        parts.append(part.text)
    return "".join(parts)


@dataclass
class TurnOutput:
    """A finished turn read back: ``content`` (None when empty beside calls), ``reasoning``
    (None without a think block) and the ``calls`` (None when none)."""

    content: str | None
    reasoning: str | None
    calls: list[op.ToolCallOut] | None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_turn(text: str, plan: ToolPlan, finish_reason: str = "stop") -> TurnOutput:
    """Split a turn's text into reasoning, content and tool calls (calls only when the request
    could call tools, the turn stopped normally and every call is complete and well-formed)."""
    parsed = tf.parse_turn(text, plan.fmt, may_call=plan.may_call, think=plan.think, final=True)
    calls = tf.finished_calls(parsed, plan.specs) if finish_reason == "stop" else None
    reasoning = parsed.reasoning if plan.think is not None and (parsed.reasoning or parsed.content
                                                                or parsed.calls) else None
    if calls:
        content = parsed.content.strip() or None
        return TurnOutput(content, reasoning, [op.ToolCallOut(id=new_call_id(), function=op.FunctionCallOut(
            name=c.name, arguments=c.arguments)) for c in calls])
    if parsed.in_calls:  # an unfinished call: answered as its text
        body = text if plan.think is None else text[text.find(tf.THINK_CLOSE) + len(tf.THINK_CLOSE):].lstrip() \
            if tf.THINK_CLOSE in text else text
        return TurnOutput(body, reasoning, None)
    return TurnOutput(parsed.content, reasoning, None)
