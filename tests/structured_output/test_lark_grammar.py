"""Lark grammars in `structured.grammar` (lark_grammar.py), checked against the Lark parser itself:
what the converted grammar accepts, character by character and through SmolLM2's tokens, Lark
parses; what Lark parses (%ignore'd text between tokens included), the converted grammar accepts,
and what it refuses, the converted grammar refuses too. Unsupported Lark is refused naming the
field and line."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest

from mmserve.errors import InvalidArgument
from mmserve.structured_output import StructuredOutputParams
from mmserve.structured_output.lark_grammar import LarkProblem, is_lark, lark_to_ebnf
from tests.structured_output.conftest import get_backend
from tests.structured_output.test_structured_generation import generate
from tests.structured_output.walk import Vocab

lark = pytest.importorskip("lark")
xgr = pytest.importorskip("xgrammar")

# vLLM's own test grammar (tests/entrypoints/conftest.py: sample_sql_lark)
SQL = """start: select_statement
select_statement: "SELECT " column " from " table " where " condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
# Lark's documentation's JSON grammar
JSON = r"""
?start: value
?value: object
      | array
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
# Lark's calculator example: left recursion, aliases, an import renamed
CALC = """
?start: sum
?sum: product
    | sum "+" product   -> add
    | sum "-" product   -> sub
?product: atom
    | product "*" atom  -> mul
    | product "/" atom  -> div
?atom: NUMBER           -> number
     | "-" atom         -> neg
     | NAME             -> var
     | "(" sum ")"
%import common.CNAME -> NAME
%import common.NUMBER
%import common.WS_INLINE
%ignore WS_INLINE
"""
# keywords without spaces of their own: %ignore puts the spaces between tokens
SQL_WS = r"""
start: "SELECT"i column ("," column)* "FROM"i NAME ["WHERE"i NAME "=" NUMBER]
column: NAME | "*"
NAME: /[a-z_][a-z0-9_]*/
%import common.NUMBER
%import common (WS, NEWLINE)
%ignore WS
%ignore "--" /[^\n]*/ NEWLINE
"""
# the rest of the syntax: case-insensitive strings, ranges, repeats, optionals, regexes,
# priorities, ! rules, comments of both kinds, a rule named root, a terminal of terminals
FEATURES = r"""
start: kw " " ID ("," ID)~0..2 [" " tail] "!"   // a comment
!kw.2: "sel"i "ect"
ID: HEX HEX | "z"~3
HEX: "a".."f"
tail: root
    | /[0-9]{2}(\.[0-9])?/   # another comment
    | "q" ESC
root: "r"+
ESC: "\"" /[^"\n]*/ "\""
"""
# repeats in a rule with %ignore: the ignored text may come between the repeats too
REPEATS = """
start: item+ ";" pair~2..3 ";" [item] ";" item* "."
item: "a" | "b"
pair: "(" item ")"
%ignore " "
"""
ALL = {"sql": SQL, "calc": CALC, "features": FEATURES, "json": JSON, "sql_ws": SQL_WS, "repeats": REPEATS}
ALPHABET = list(' ;SELCTfromwhe_12345670.+-*/()"{}[]:,=abcdzqrtunlsxEei!\\\n\t')


@functools.cache
def _lark_parser(name: str) -> Any:
    return lark.Lark(ALL[name], parser="earley", lexer="dynamic_complete")


def _lark_accepts(name: str, text: str) -> bool:
    try:
        _lark_parser(name).parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def _expected(name: str, text: str) -> bool:
    """What the converted grammar should say: Lark's verdict, except that %ignore'd text (here
    always ending in whitespace) is not allowed after the whole text."""
    return _lark_accepts(name, text) and not ("%ignore" in ALL[name] and text[-1:].isspace())


@functools.cache
def _compiled(name: str) -> Any:
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    return xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(lark_to_ebnf(ALL[name]))


def _xgr_text_accepts(ebnf: str, text: str) -> bool:
    return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text))


def _xgr_accepts(name: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(_compiled(name))
    return (not text or matcher.accept_string(text)) and bool(matcher.accept_token(2))


def _walks(name: str, rng: random.Random, count: int) -> set[str]:
    """Complete strings of the converted grammar, by random walks a character at a time (the
    longest complete one of each walk)."""
    found: set[str] = set()
    for _ in range(count):
        matcher, text, complete = xgr.GrammarMatcher(_compiled(name)), "", None
        for _ in range(rng.randint(3, 80)):
            for char in rng.sample(ALPHABET, len(ALPHABET)):
                if matcher.accept_string(char):
                    text += char
                    break
            else:
                break
            if _xgr_accepts(name, text):
                complete = text
        if complete is not None:
            found.add(complete)
    return found


def test_without_start_the_first_rule_starts() -> None:
    """vLLM's documentation's JSON grammar has no `start`: its first rule, `value`, is the root
    (as vLLM takes it), and a rule named `root` elsewhere keeps its place."""
    text = JSON.replace("?start: value\n", "") + 'extra: root\nroot: "r"\n'
    ebnf = lark_to_ebnf(text)
    assert ebnf.startswith("root ::= lark_gap lark_start\n") and "lark_start ::= object | array" in ebnf
    lark_json = lark.Lark(text, parser="earley", lexer="dynamic_complete", start="value")
    for sample in ['{"a": [1, {"b": null}]}', "[true , false]", '"x"']:
        lark_json.parse(sample)
        assert _xgr_text_accepts(ebnf, sample)
    assert lark_to_ebnf('a: "x" b\nb: root\nroot: "y"').splitlines()[:2] == ['root ::= "x" b', "b ::= lark_root"]


def test_sql_converts_to_the_ebnf_vllm_users_expect() -> None:
    assert lark_to_ebnf(SQL) == (
        "root ::= select_statement\n"
        'select_statement ::= "SELECT " column " from " table " where " condition\n'
        'column ::= "col_1" | "col_2"\n'
        'condition ::= column "=" number\n'
        'number ::= "1" | "2"\n'
        'table ::= "table_1" | "table_2"\n'
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (SQL, True),
        (JSON, True),
        ("%import common.WS\nstart: WS", True),
        ("?start: a\na.2: \"x\"", True),
        ('root ::= "a" | b\nb ::= [a-z]', False),
        ('# note: not lark\nroot ::= "x:y"\n', False),
        ('root ::= item\nitem ::= "k" ":" "v"', False),
        ("", False),
    ],
)
def test_lark_is_told_from_ebnf(text: str, expected: bool) -> None:
    assert is_lark(text) is expected


@pytest.mark.parametrize("name", list(ALL))
def test_what_the_converted_grammar_accepts_lark_parses(name: str) -> None:
    samples = _walks(name, random.Random(0), 150)
    assert len(samples) > 10
    for text in samples:
        assert _lark_accepts(name, text), text


@pytest.mark.parametrize("name", list(ALL))
def test_both_accept_the_same_strings(name: str) -> None:
    """Walked strings, each cut and each with one character changed, inserted or removed,
    and random strings: Lark and the converted grammar give the same verdict on all."""
    rng = random.Random(1)
    walked = sorted(_walks(name, rng, 100))
    samples = set(walked)
    for text in walked[:60]:
        i = rng.randrange(len(text) + 1)
        c = rng.choice(ALPHABET)
        samples.update({text[:i], text[:i] + c + text[i:], text[:i] + c + text[i + 1 :]})
        samples.add(text[:i] + text[i + 1 :])
    samples.update("".join(rng.choices(ALPHABET, k=rng.randint(1, 6))) for _ in range(300))
    accepted = 0
    for text in samples:
        verdict = _expected(name, text)
        assert _xgr_accepts(name, text) is verdict, text
        accepted += verdict
    assert 0 < accepted < len(samples)


def test_features_accept_and_refuse_what_lark_does() -> None:
    for text, ok in [
        ("SeLect ab!", True),
        ("select ab,zzz,cd r!", True),
        ("select ab,cd,ef,ab!", False),  # ~0..2 more after the first
        ("select ab 42!", True),
        ("select ab 42.5!", True),
        ('select ab q"it\'s"!', True),
        ("select ab rrr!", True),
        ("select ag!", False),
        ("select zz!", False),
        ("SELECT ab!", False),  # "ect" is case-sensitive
    ]:
        assert _lark_accepts("features", text) is ok, text
        assert _xgr_accepts("features", text) is ok, text


@pytest.mark.parametrize(
    ("name", "text", "ok"),
    [
        ("repeats", " a b a ; (a) (b) ; b ; a a .", True),
        ("repeats", "ab;(a)(b)(a);;.", True),
        ("repeats", "a;( a ) ( b );;.", True),
        ("repeats", "a;(a);;.", False),  # ~2..3
        ("repeats", "a;(a)(b)(a)(b);;.", False),
        ("repeats", "a;(a)(b);a b;.", False),  # [item]: one at most
        ("json", '[1 , 2 ,3 ,\n 4]', True),
        ("json", '{ "a" : 1 , "b" :[ ] , "c":{}}', True),
        ("json", '[1 2]', False),
        ("calc", " 1 + 2 * ( x - 3 ) / 4", True),
        ("calc", "1 + + 2", False),
        ("sql_ws", "SELECT a , b FROM t WHERE c = 1", True),
        ("sql_ws", "select * -- all of it\n from t", True),
        ("sql_ws", "SELECT a FROM t ", False),  # (Lark: True; nothing ignored after the text)
        ("sql_ws", "SELECT a b FROM t", False),
    ],
)
def test_ignored_text_where_lark_skips_it(name: str, text: str, ok: bool) -> None:
    assert _expected(name, text) is ok
    assert _xgr_accepts(name, text) is ok


def test_through_the_backend_and_smollm2_tokens(tokenizer: Any, vocab: Vocab) -> None:
    """A Lark grammar in a request: random walks over real tokens, each output parsed by Lark."""
    backend = get_backend(tokenizer, "xgrammar")
    for name in ("sql", "calc", "json"):  # (sql_ws allows comments of any text: walks wander)
        params = StructuredOutputParams("grammar", ALL[name])
        for seed in range(3):
            text = generate(backend, params, vocab, tokenizer, seed)
            assert _lark_accepts(name, text), (name, text)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("start: _sep{a, b}\n_sep{x, y}: x (y x)*", ["templates", "line 2"]),
        ("start: a\n%declare a", ["%declare", "line 2"]),
        ("start: A\n%import .other.A", ["only %import common", "line 2"]),
        ("start: /ab/i", ["flags", "line 1"]),
        ("start: a\nb: \"x\"", ["a is used but not defined"]),
        ("ITEM: \"x\"", ["no rule to start from"]),
        ('start: "a"\nstart: "b"', ["defined twice", "line 2"]),
        ('start: "a".."zz"', ["bad range"]),
        ('start: "a"~3..1', ["backwards"]),
        ('start: ("a"', ["expected ')'"]),
        ("start: WS\n%import common.NOPE -> WS", ["common.lark has no NOPE"]),
        ("start: /(?<=a)b/", ["regex", "not supported"]),
        ("start: " + "(" * 3000 + '"a"' + ")" * 3000, ["nested too deeply", "line 1"]),
    ],
)
def test_unsupported_lark_is_refused_by_field_and_line(
    text: str, words: list[str], tokenizer: Any
) -> None:
    with pytest.raises(LarkProblem) as direct:
        lark_to_ebnf(text)
    for word in words:
        assert word in str(direct.value)
    with pytest.raises(InvalidArgument) as err:
        get_backend(tokenizer, "xgrammar").compile(StructuredOutputParams("grammar", text))
    assert err.value.field == "structured.grammar" and words[0] in str(err.value)
