"""The private part of vLLM's ``Request`` that the connector's last-token rule edits
(``SchedulerSide.on_new_request``: P drops the prompt's last token), read from source
(docs/vllm.md, "The last-token rule"). vLLM offers no public way to prefill a request one
token short; its own NixlConnector, MooncakeConnector and MoRIIO connector make the same
edit. :data:`RELIED_ON` is what the edit needs; :func:`request_facts` reads it from a
``vllm/v1/request.py``, :func:`missing` says what of it a reading lacks."""

from __future__ import annotations

import ast

FIELDS = ("_all_token_ids", "all_token_ids", "prompt_token_ids", "num_prompt_tokens", "max_tokens")

RELIED_ON: dict[str, list[str]] = {
    # among __init__'s assignments (token ids: a copy of the prompt, so the rule deletes
    # from both lists; the public view wraps the private list, so it follows the deletion)
    "init": [
        "self._all_token_ids = self.prompt_token_ids.copy()",
        "self.all_token_ids = ConstantList(self._all_token_ids)",
        "self.prompt_token_ids = prompt_token_ids",
        "self.max_tokens = sampling_params.max_tokens",
    ],
    # the scheduler's count of a request's tokens is the private list's length
    "num_tokens": ["return len(self._all_token_ids)"],
    # sampled tokens are appended to the private list (after the shortened prompt)
    "append_output_token_ids": [
        "self._all_token_ids.append(token_ids)",
        "self._all_token_ids.extend(token_ids)",
    ],
}
"""What the rule needs, by key of :func:`request_facts`; and none of :data:`FIELDS` may be
a property (the rule assigns them)."""


def _request(source: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "Request":
            return node
    raise LookupError("no class Request in the source")


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"Request has no method {name}")


def _statements(fn: ast.FunctionDef) -> list[str]:
    return [ast.unparse(s) for s in ast.walk(fn) if isinstance(s, ast.stmt) and s is not fn]


def request_facts(source: str) -> dict[str, list[str]]:
    """From ``vllm/v1/request.py``'s text: ``init``: ``__init__``'s assignments to
    :data:`FIELDS` (annotations dropped); ``num_tokens``, ``append_output_token_ids``:
    their statements on ``self._all_token_ids``; ``properties``: which of
    :data:`FIELDS` are properties."""
    cls = _request(source)
    init = []
    for s in ast.walk(_method(cls, "__init__")):
        if not isinstance(s, ast.Assign | ast.AnnAssign) or s.value is None:
            continue
        target = s.targets[0] if isinstance(s, ast.Assign) else s.target
        if isinstance(target, ast.Attribute) and target.attr in FIELDS:
            init.append(f"{ast.unparse(target)} = {ast.unparse(s.value)}")
    props = [
        n.name
        for n in cls.body
        if isinstance(n, ast.FunctionDef)
        and n.name in FIELDS
        and any(getattr(d, "id", "") == "property" for d in n.decorator_list)
    ]

    def on_tokens(name: str) -> list[str]:
        stmts = _statements(_method(cls, name))
        return [s for s in stmts if "self._all_token_ids" in s and "\n" not in s]

    return {
        "init": init,
        "num_tokens": on_tokens("num_tokens"),
        "append_output_token_ids": on_tokens("append_output_token_ids"),
        "properties": sorted(props),
    }


def edits(source: str, field: str = "_all_token_ids") -> list[str]:
    """Statements of ``source`` that delete from or assign to ``request.<field>`` (vLLM's
    own connectors: the same edit as ours, while vLLM offers nothing public)."""
    out = []
    for s in ast.walk(ast.parse(source)):
        targets = s.targets if isinstance(s, ast.Delete | ast.Assign) else []
        for t in targets:
            t = t.value if isinstance(t, ast.Subscript) else t
            if isinstance(t, ast.Attribute) and t.attr == field:
                out.append(ast.unparse(s))
    return out


def missing(facts: dict[str, list[str]]) -> list[str]:
    """What of :data:`RELIED_ON` ``facts`` lacks or contradicts, one line each."""
    out = [
        f"Request.{key}: no `{line}`"
        for key, lines in RELIED_ON.items()
        for line in lines
        if line not in facts.get(key, [])
    ]
    out += [f"Request.{p} is a property" for p in facts.get("properties", [])]
    return out
