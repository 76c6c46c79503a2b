"""star_fold: a repetition folded into the terminal after it, in xgrammar's normalised EBNF.
The rewrite is checked against golden text, left out where it does not apply, and its
grammars accept exactly what the originals do: random walks on each grammar, character by
character, each prefix and each end checked against the other. Through the backend, a user's
EBNF grammar is compiled folded."""

from __future__ import annotations

import functools
import random

import pytest

from mmserve.structured_output.star_fold import fold_star_terminals

xgr = pytest.importorskip("xgrammar")

# llama.cpp's json.gbnf, cut down: a string is "\"" char* "\""
JSON_GBNF = r"""root ::= object
value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= "" | " " | "\n" [ \t]{0,20}
"""
# a string through a rule that is only a repetition
ALIAS = r"""root ::= "[" string ("," string)* "]"
string ::= "\"" chars "\""
chars ::= char*
char ::= [^"\\] | "\\" (["\\n] | "u" [0-9a-c]{2})
"""
ALIAS_TWICE = r"""root ::= "<" chars ">" chars "!"
chars ::= ("a" | "bc")*
"""
GRAMMARS = {
    "json.gbnf": JSON_GBNF,
    "class after": r'root ::= "<" [a-c]* [>] | "(" ("x" | "yz")* ")" "!"',
    "nested": r'root ::= "[" ("(" [ab]* ")")* "]"',
    "rule after": r'root ::= "a"* tail' + "\n" + r'tail ::= "b" | "c"',
    "at the end": r'root ::= "q" inner' + "\n" + r'inner ::= "a" "b"*',
    "shared": r'root ::= "x" rep "!" | "y" rep "?"' + "\n" + r'rep ::= "" | "ab" rep',
    "names in literals": r'root ::= "[" "a"* "]" "root_1 \"]\" x"',
    "star in star": r'root ::= "[" ("(" ("a" | "bc")* ")")* "]"',
    "three ways": r'root ::= "<" rep ">"' + "\n" + r'rep ::= "" | "a" | "b" rep',
    "hyphens": r'root ::= "[" item-name ("," item-name)* "]"' + "\n"
    + r'item-name ::= "\"" ( [^"\\] | "\\" "u" [0-9]{2} )* "\""',
    "alias": ALIAS,
    "alias used twice": ALIAS_TWICE,
}
ALPHABET = list('{}[]"\\,: \n\ta-bcxyz0129.eE+!?<>()/u')


def _normalised(ebnf: str) -> str:
    return str(xgr.Grammar.from_ebnf(ebnf))


def test_a_json_gbnf_string_is_folded() -> None:
    """`"\\"" char* "\\""` becomes a right-recursive rule holding the closing quote; the rest of
    the grammar stays as xgrammar wrote it."""
    text = _normalised(JSON_GBNF)
    assert 'string ::= (("\\"" string_2 "\\"" ws))' in text
    assert 'string_2 ::= ("" | (string_2_2 string_2))' in text
    folded = fold_star_terminals(text)
    assert 'string ::= (("\\"" string_2_then ws))' in folded
    assert folded.endswith('string_2_then ::= (("\\"") | (string_2_2 string_2_then))\n')
    assert [line for line in folded.splitlines() if "string_2_then" not in line] == [
        line for line in text.splitlines() if not line.startswith("string ::=")
    ]


@pytest.mark.parametrize("name", ["rule after", "at the end", "shared"])
def test_it_is_left_out_where_it_does_not_apply(name: str) -> None:
    """A repetition followed by a rule, ending its sequence, or referenced twice: unchanged."""
    text = _normalised(GRAMMARS[name])
    assert fold_star_terminals(text) == text


def test_a_rule_that_is_only_a_repetition_is_folded_as_one() -> None:
    """`chars ::= char*` used once before a terminal: chars becomes the repetition, folded."""
    text = _normalised(GRAMMARS["alias"])
    assert "chars ::= ((chars_1))" in text
    folded = fold_star_terminals(text)
    assert 'string ::= (("\\"" chars_then))' in folded
    assert 'chars_then ::= (("\\"") | (char chars_then))' in folded
    assert fold_star_terminals(_normalised(GRAMMARS["alias used twice"])) == _normalised(GRAMMARS["alias used twice"])


def test_rule_names_inside_literals_are_not_references() -> None:
    text = _normalised(GRAMMARS["names in literals"])
    folded = fold_star_terminals(text)
    assert folded != text and '"root_1 \\"]\\" x"' in folded


@functools.cache
def _compiled(ebnf: str) -> object:
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    return xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(ebnf)


def _matcher(ebnf: str) -> object:
    return xgr.GrammarMatcher(_compiled(ebnf))


def _walk(ebnf: str, rng: random.Random, steps: int) -> list[str]:
    """A random walk, one character at a time, on what the grammar accepts: its prefixes."""
    matcher, text, prefixes = _matcher(ebnf), "", [""]
    for _ in range(steps):
        for char in rng.sample(ALPHABET, len(ALPHABET)):
            if matcher.accept_string(char):
                text += char
                prefixes.append(text)
                break
        else:
            break
    return prefixes


def _verdict(ebnf: str, text: str) -> tuple[bool, bool]:
    """(text is a prefix of the language, text is in it)."""
    matcher = _matcher(ebnf)
    if text and not matcher.accept_string(text):
        return False, False
    return True, bool(matcher.accept_token(2))


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_folded_grammars_accept_the_same_language(name: str) -> None:
    text = _normalised(GRAMMARS[name])
    folded = fold_star_terminals(text)
    rng = random.Random(0)
    samples: set[str] = set()
    for ebnf in (text, folded):
        for _ in range(100):
            samples.update(_walk(ebnf, rng, 60))
    samples.update("".join(rng.choices(ALPHABET, k=rng.randint(1, 8))) for _ in range(1000))
    samples.update(s + c for s in list(samples)[:300] for c in '"]\\!')  # one step past a prefix
    for sample in samples:
        assert _verdict(folded, sample) == _verdict(text, sample), sample


def test_the_backend_compiles_a_grammar_folded(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A user's EBNF grammar reaches xgrammar folded, and its matcher follows the language."""
    from mmserve.structured_output import StructuredOutputParams
    from tests.structured_output.conftest import get_backend

    compiled = get_backend(tokenizer, "xgrammar").compile(StructuredOutputParams("grammar", JSON_GBNF))
    assert "_then ::= " in str(compiled._compiled.grammar)  # type: ignore[attr-defined]
    matcher = compiled.matcher()
    for token in tokenizer.encode('{"k": ["a\\"b", 1.5]}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.accept_token(2)


def test_a_fold_xgrammar_refuses_falls_back_to_the_grammar(tokenizer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Should a fold ever not compile, the grammar compiles as the user wrote it."""
    from mmserve.structured_output import StructuredOutputParams, xgrammar_backend
    from tests.structured_output.conftest import get_backend

    monkeypatch.setattr(xgrammar_backend, "fold_star_terminals", lambda text: text + "broken ::=\n")
    compiled = get_backend(tokenizer, "xgrammar").compile(StructuredOutputParams("grammar", JSON_GBNF))
    assert "_then ::= " not in str(compiled._compiled.grammar)  # type: ignore[attr-defined]
    matcher = compiled.matcher()
    assert all(matcher.accept_token(t) for t in tokenizer.encode('{"k": 1}', add_special_tokens=False))


def test_a_text_that_does_not_parse_back_is_not_folded(tokenizer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The fold works on the grammar's printed text; where that text would not parse back to
    the same grammar, the grammar compiles as it is."""
    from mmserve.structured_output import StructuredOutputParams, xgrammar_backend
    from tests.structured_output.conftest import get_backend

    parse = xgr.Grammar.from_ebnf
    calls: list[str] = []

    def reparsed_differently(text: str, root_rule_name: str = "root") -> object:
        calls.append(text)
        return parse(text + ("\nextra ::= \"x\"" if len(calls) == 2 else ""), root_rule_name=root_rule_name)

    monkeypatch.setattr(xgrammar_backend.xgr.Grammar, "from_ebnf", staticmethod(reparsed_differently))
    compiled = get_backend(tokenizer, "xgrammar").compile(StructuredOutputParams("grammar", JSON_GBNF))
    assert len(calls) == 2  # the request's grammar, then its printed text
    assert "_then ::= " not in str(compiled._compiled.grammar)  # type: ignore[attr-defined]
