"""What a request constrains its output to -> one engine Grammar (or None): response_format
(json_object / json_schema), vLLM's guided_json / guided_regex / guided_choice / guided_grammar
(Lark), or a forced tool call (tool_choice 'required' or a named function, in the chat format's
own tool-call syntax). At most one of them per request; each mistake is a 400 naming it.
"""

from __future__ import annotations

import json

from ..engine.structured import StructuredUnavailable
from .errors import ApiError
from .tool_calls import ToolFormat


def _grammars(llm, param: str):
    try:
        return llm.grammars
    except StructuredUnavailable as e:
        raise ApiError(str(e), param) from None


def _marker(llm):
    """A marker string as a Lark atom: a special-token reference when the tokenizer has it as one
    special token (the grammar must produce that token, not its spelling), else a literal."""
    tok = llm.tokenizer

    def atom(s: str) -> str:
        tid = tok.tok.token_to_id(s) if tok is not None else None
        if tid is not None and tok.is_special(tid):
            return f"<[{tid}]>"
        return json.dumps(s)

    return atom


def request_grammar(llm, req, tools: list[dict] | None, tool_format: ToolFormat | None):
    """-> engine.structured.Grammar or None."""
    asked = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        asked.append("response_format")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(req, name) is not None:
            asked.append(name)
    forced = _forced_tools(req, tools)
    if forced is not None:
        asked.append("tool_choice")
    if len(asked) > 1:
        raise ApiError(f"only one output constraint per request, got {', '.join(asked)}", asked[1])
    if not asked:
        return None
    param = asked[0]
    g = _grammars(llm, param)
    try:
        if param == "response_format":
            if rf.type == "json_object":
                return g.json_object()
            return g.json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")
        if param == "guided_json":
            schema = req.guided_json
            if isinstance(schema, str):
                schema = json.loads(schema)
            return g.json_schema(schema, "guided_json")
        if param == "guided_regex":
            return g.regex(req.guided_regex)
        if param == "guided_choice":
            return g.choice(req.guided_choice)
        if param == "guided_grammar":
            return g.lark(req.guided_grammar)
        parallel = req.parallel_tool_calls is not False
        return g.lark(tool_format.grammar(forced, parallel, _marker(llm)), "tool_choice")
    except (ValueError, TypeError) as e:
        raise ApiError(f"invalid '{param}': {e}", param) from None


def _forced_tools(req, tools: list[dict] | None) -> list[dict] | None:
    """The functions a call is forced among (tool_choice 'required' or named), else None."""
    choice = getattr(req, "tool_choice", None)
    if choice is None or choice in ("none", "auto") or not tools:
        return None
    if choice == "required":
        return tools
    named = [t for t in tools if t["name"] == choice.function.name]
    if not named:
        raise ApiError(
            f"tool_choice names function {choice.function.name!r}, which is not in 'tools'", "tool_choice"
        )
    return named
