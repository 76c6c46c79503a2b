"""Whether a chat template reads a message's content as a list of parts, from its jinja AST.

transformers renders content as it is given: a list of parts stays a list. Templates that
loop over the parts (Llama 4, Gemma 3, Qwen2.5-VL, ...) render text parts their own way
(joined with nothing, trimmed, ...), while most others print the content as one string and
break on a list (a Python repr, or `str + list`). So text-only parts stay a list for the
first kind and are joined for the rest, as vLLM's "auto" content format decides with its own
AST walk (`_detect_content_format`). This walk follows the content through `set` and into
any macro it is passed to, by position or keyword (Qwen3-VL's and Qwen3.5's
`render_content(message.content, ...)`, MiMo-V2.5's `render_content(message_content)`), and
reads `msg.get('content')` too (Kimi K2 Thinking's `render_content(message)`, which vLLM's
walk misses). A loop over the content counts only if it reads its items as parts ("type",
"text", "image", "image_url"), so that Mistral Nemo's `set tool_calls = message.content`,
looped over as tool calls, does not make every message a list.

A template whose part loops all run unguarded (SmolVLM, Idefics2/3, llava-onevision) reads
only lists: given a string, its loop walks the characters, finds no "type", and the text
vanishes without an error. vLLM wraps every string in a text part for any template that
loops over parts; but a template with a string branch (Llama 3.2 Vision, Llama 4, Gemma 3)
renders the two differently and reads a system string outside its loops (`content | trim`),
so strings are wrapped only for templates none of whose part loops sits under an
`is string` test of the content ("parts_only").
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal

from jinja2 import nodes
from jinja2.exceptions import TemplateError

# keys a template reads from a content part (OpenAI's and transformers' part shapes)
PART_KEYS = frozenset({"type", "text", "image", "image_url"})
# filters that look into the items of a list: `content | selectattr('type', 'equalto', 'text')`
_ITEM_FILTERS = frozenset({"selectattr", "rejectattr", "map", "groupby", "sort", "unique"})


# How a message's content reaches a template:
# "string": as one string (text parts joined); "parts": text parts as a list, a string as it
# is (the template branches on `is string`); "parts_only": always a list (a string wrapped as
# one text part)
ContentFormat = Literal["string", "parts", "parts_only"]


def reads_parts(template: str) -> bool:
    """Whether some loop over a message's content reads its items as parts (so text parts
    reach the template as a list, as transformers passes them)."""
    return content_format(template) != "string"


@lru_cache(maxsize=64)
def content_format(template: str) -> ContentFormat:
    """"string" unless some loop over a message's content reads its items as parts; then
    "parts" if one of those loops sits under an `is string` test of the content, else
    "parts_only" (the template cannot render a string)."""
    try:
        tree = _parse_environment().parse(template)
    except TemplateError:
        return "string"  # rendering reports it
    held = _content_names(tree)
    part_loops = [
        guarded
        for loop, guarded in _loops(tree, held, guarded=False)
        if _holds_content(loop.iter, held) and _reads_items_as_parts(loop)
    ]
    if not part_loops:
        return "string"
    return "parts" if any(part_loops) else "parts_only"


def _loops(
    node: nodes.Node, held: frozenset[str], guarded: bool
) -> Iterator[tuple[nodes.For, bool]]:
    """Each loop, and whether it sits in an `if` (its body, elif or else) whose test asks
    whether the content is a string."""
    if isinstance(node, nodes.If) and _tests_for_string(node.test, held):
        guarded = True
    if isinstance(node, nodes.For):
        yield node, guarded
    for child in node.iter_child_nodes():
        yield from _loops(child, held, guarded)


def _tests_for_string(test: nodes.Node, held: frozenset[str]) -> bool:
    """`content is string` (or `is not string`, within and/or) on something holding content."""
    return any(
        isinstance(node, nodes.Test) and node.name == "string" and _holds_content(node.node, held)
        for node in _walk(test)
    )


@lru_cache(maxsize=1)
def _parse_environment() -> Any:
    """A jinja environment that parses what transformers renders (its `{% generation %}` tag
    and loop controls): transformers' own where this version has it (a private function),
    else a sandbox with those extensions."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template("").environment
    except (ImportError, AttributeError, TypeError):
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(Extension):  # `{% generation %}...{% endgeneration %}`: its body
            tags = {"generation"}  # noqa: RUF012 (jinja reads the class attribute)

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body, lineno=lineno)

        return ImmutableSandboxedEnvironment(extensions=[_Generation, loopcontrols])


def _content_names(tree: nodes.Template) -> frozenset[str]:
    """Names that may hold a message's content: set from it, or a macro's parameter it is
    passed to, to a fixed point (a macro may hand it on). Names are not scoped, as in vLLM's
    walk: the part-reading check on the loop keeps a name reused elsewhere harmless."""
    macros = {m.name: m for m in tree.find_all(nodes.Macro)}
    held: set[str] = set()
    while True:
        found = {
            name
            for name, value in _bindings(tree, macros)
            if name not in held and _holds_content(value, held)
        }
        if not found:
            return frozenset(held)
        held |= found


def _bindings(
    tree: nodes.Template, macros: dict[str, nodes.Macro]
) -> Iterator[tuple[str, nodes.Node]]:
    """(name, value) for each `set name = value` and each argument a macro's call binds."""
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name):
            yield assign.target.name, assign.node
    for call in tree.find_all(nodes.Call):
        macro = macros.get(call.node.name) if isinstance(call.node, nodes.Name) else None
        if macro is None:
            continue
        params = [p.name for p in macro.args]
        yield from zip(params, call.args, strict=False)  # extra arguments go to varargs
        for kwarg in call.kwargs:
            if kwarg.key in params:
                yield kwarg.key, kwarg.value


def _holds_content(node: nodes.Node | None, held: set[str] | frozenset[str]) -> bool:
    """`x.content`, `x['content']`, `x.get('content')` or a held name, through filters,
    tests, slices and `a if c else b`."""
    node = _unwrap(node)
    if isinstance(node, nodes.CondExpr):
        return _holds_content(node.expr1, held) or _holds_content(node.expr2, held)
    if isinstance(node, nodes.Name):
        return node.name in held
    return _key_read(node) == "content"


def _unwrap(node: nodes.Node | None) -> nodes.Node | None:
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
    return node


def _key_read(node: nodes.Node | None) -> Any:
    """The constant key `x.key`, `x['key']` or `x.get('key')` reads, else None."""
    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value
    if (
        isinstance(node, nodes.Call)
        and isinstance(node.node, nodes.Getattr)
        and node.node.attr == "get"
        and node.args
        and isinstance(node.args[0], nodes.Const)
    ):
        return node.args[0].value
    return None


def _reads_items_as_parts(loop: nodes.For) -> bool:
    """Whether the loop reads a part key of its items: `item.type`, `item['text']`,
    `'image' in item`, or a filter over their keys on what it iterates."""
    if any(_filters_on_part_keys(f) for f in _filters(loop.iter)):
        return True
    items = {n.name for n in _walk(loop.target) if isinstance(n, nodes.Name)}
    scope = [*loop.body, *loop.else_, *([loop.test] if loop.test else [])]
    return any(_reads_part_key(node, items) for stmt in scope for node in _walk(stmt))


def _walk(node: nodes.Node) -> Iterator[nodes.Node]:
    yield node
    yield from node.find_all(nodes.Node)


def _filters(node: nodes.Node | None) -> Iterator[nodes.Filter]:
    while isinstance(node, (nodes.Filter, nodes.Test, nodes.Getitem)):
        if isinstance(node, nodes.Filter):
            yield node
        node = node.node


def _filters_on_part_keys(f: nodes.Filter) -> bool:
    values = [*f.args, *(k.value for k in f.kwargs)]
    return f.name in _ITEM_FILTERS and any(
        isinstance(v, nodes.Const) and v.value in PART_KEYS for v in values
    )


def _reads_part_key(node: nodes.Node, items: set[str]) -> bool:
    if not isinstance(node, (nodes.Getattr, nodes.Getitem, nodes.Call, nodes.Compare)):
        return False
    if isinstance(node, nodes.Compare):  # `'text' in item`
        return (
            isinstance(node.expr, nodes.Const)
            and node.expr.value in PART_KEYS
            and any(op.op in ("in", "notin") and _is_name(op.expr, items) for op in node.ops)
        )
    if _key_read(node) not in PART_KEYS:
        return False
    if isinstance(node, nodes.Call):  # `item.get('type')`: what `.get` is read from
        node = node.node
    return isinstance(node, (nodes.Getattr, nodes.Getitem)) and _is_name(node.node, items)


def _is_name(node: nodes.Node | None, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.name in names
