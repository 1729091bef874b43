"""Claim expectations: a tiny grammar, parsed by hand (no `eval`).

    expect := CMP expr | 'within' TOL 'of' expr | 'between' expr 'and' expr
    CMP    := '<' | '<=' | '>' | '>=' | '=='
    expr   := term (('+' | '-') term)*
    term   := atom ('*' atom)*
    atom   := NUMBER | METRIC_NAME | 'true' | 'false' | "quoted string" | '-' atom | '(' expr ')'
    TOL    := NUMBER ['%']          # '%' makes the tolerance relative to |X|

Examples: `< 1e-6`, `> fedavg_acc + 0.02`, `< 0.5 * fedavg_dist`, `within 5% of 0.91`, `between 0.4 and 0.6`.
Names on the right-hand side are other recorded metrics of the same run.
"""
from __future__ import annotations

import math
import numbers
import operator
import re
import sys
from dataclasses import dataclass, field

import numpy as np

_TOKEN = re.compile(r"""\s*(?:
      (?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
    | (?P<name>[A-Za-z_]\w*)
    | (?P<str>"[^"]*"|'[^']*')
    | (?P<op><=|>=|==|[<>+\-*%()])
    )""", re.VERBOSE | re.ASCII)  # ASCII digits only: float() reads '١' (Arabic-Indic one) as 1

_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq}
_ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_KEYWORDS = {"within", "of", "between", "and", "true", "false"}
_NOT_FINITE = {"inf", "infinity", "nan"}
MAX_DEPTH = 32      # nested '(' / unary '-': deeper input would exhaust Python's recursion limit
MAX_TOKENS = 256    # a long chain 'a + a + …' nests as deeply as parentheses do


class ExpectationError(ValueError):
    """The expectation text does not follow the grammar above."""


class MetricError(Exception):
    """A metric the expectation needs was not recorded, or is NaN / infinite."""


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            odd = next((c for c in text[pos:] if not c.isascii()), None)
            if odd is not None:
                raise ExpectationError(f"expectation {_short(text)} holds the non-ASCII character {odd!r} "
                                       f"(U+{ord(odd):04X}); write numbers and names in ASCII (digits 0-9)")
            raise ExpectationError(f"cannot read {text[pos:]!r} in expectation {text!r}")
        kind = m.lastgroup
        tokens.append((kind, m.group(kind)))
        pos = m.end()
    return tokens


class _Parser:
    """Recursive descent over the token list; expressions become nested tuples."""

    def __init__(self, text: str):
        self.text, self.tokens, self.i, self.depth = text, _tokenize(text), 0, 0
        if len(self.tokens) > MAX_TOKENS:
            raise ExpectationError(f"expectation {_short(text)} has {len(self.tokens)} tokens; at most {MAX_TOKENS} "
                                   "are allowed (record the combined value as its own metric instead)")

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else (None, None)

    def take(self, value: str | None = None):
        kind, tok = self.peek()
        if kind is None or (value is not None and tok != value):
            want = f"{value!r}" if value else "more text"
            raise ExpectationError(f"expected {want} in expectation {self.text!r}, got {tok or 'the end'!r}")
        self.i += 1
        return kind, tok

    def expr(self):
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            node = self._arith(self.take()[1], node, self.term())
        return node

    def term(self):
        node = self.atom()
        while self.peek()[1] == "*":
            self.take()
            node = self._arith("*", node, self.atom())
        return node

    def _arith(self, op: str, left, right):
        """(op, left, right), refused when a side is a quoted string: text is compared with ==, never computed."""
        if any(side[0] == "num" and isinstance(side[1], str) for side in (left, right)):
            raise ExpectationError(f"expectation {_short(self.text)} does arithmetic on a quoted string; a string "
                                   "can only stand alone after ==")
        return (op, left, right)

    def atom(self):
        kind, tok = self.take()
        if tok in ("-", "("):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpectationError(f"expectation {_short(self.text)} nests parentheses / '-' more than "
                                       f"{MAX_DEPTH} deep; simplify it")
        if kind == "num":
            value = float(tok)
            if not math.isfinite(value):  # '1e999' parses to inf: a bound that every value meets
                raise ExpectationError(f"the number {tok!r} in expectation {_short(self.text)} is not finite; "
                                       "write a finite bound")
            return ("num", value)
        if kind == "str":
            return ("num", tok[1:-1])  # a constant, compared with ==
        if tok in ("true", "false"):
            return ("num", tok == "true")
        if kind == "name" and tok.lower() in _NOT_FINITE:
            raise ExpectationError(f"{tok!r} in expectation {_short(self.text)} is not a finite number; write a "
                                   "finite bound (a metric cannot be named so)")
        if kind == "name" and tok not in _KEYWORDS:
            return ("metric", tok)
        if tok == "-":
            node = self._arith("*", ("num", -1.0), self.atom())
            self.depth -= 1
            return node
        if tok == "(":
            node = self.expr()
            self.take(")")
            self.depth -= 1
            return node
        raise ExpectationError(f"expected a number or a metric name in expectation {self.text!r}, got {tok!r}")

    def end(self):
        if self.i != len(self.tokens):
            raise ExpectationError(f"unexpected {self.tokens[self.i][1]!r} in expectation {self.text!r}")


def _short(text: str) -> str:
    """The expectation for an error message, cut to a readable length."""
    return repr(text) if len(text) <= 80 else repr(text[:60]) + f"… ({len(text)} characters)"


def _names(node) -> set[str]:
    if node[0] == "metric":
        return {node[1]}
    if node[0] == "num":
        return set()
    return _names(node[1]) | _names(node[2])


def _value(node, metrics: dict):
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "metric":
        return metric_value(metrics, node[1])
    left, right = _value(node[1], metrics), _value(node[2], metrics)
    if isinstance(left, (str, bytes)) or isinstance(right, (str, bytes)):  # "ab" * n would build a string of n copies
        raise MetricError(f"the expectation does arithmetic on text ({left!r:.40} {kind} {right!r:.40}); text can "
                          "only be compared with ==")
    if not (_is_number(left) and _is_number(right)):  # [0] * n builds a list of n items; a dict + 1 is a TypeError
        raise MetricError(f"the expectation does arithmetic on a non-number ({type(left).__name__} {kind} "
                          f"{type(right).__name__}); arithmetic takes numbers only: compare a list or mapping with ==")
    out = _ARITH[kind](left, right)
    if isinstance(out, float) and not math.isfinite(out):  # e.g. metric * 1e308: a bound every value meets
        raise MetricError(f"the expectation's arithmetic overflows to {out}")
    return out


def _is_number(x) -> bool:
    """A real number, or an array of them (per-seed values, judged seed by seed); not a list, text or a bool."""
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "iuf"
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_finite(node, text: str) -> None:
    """Refuse a constant part of an expression that folds to inf or NaN ('1e308 * 10'), at any step."""
    if node[0] in ("num", "metric"):
        return
    _check_finite(node[1], text)
    _check_finite(node[2], text)
    x = _constant(node)
    if isinstance(x, float) and not math.isfinite(x):
        raise ExpectationError(f"expectation {_short(text)} has a constant that overflows to {x}; write a finite "
                               "bound")


def metric_value(metrics: dict, name: str):
    """The recorded value of `name`; MetricError when missing or stored as null (NaN / infinite)."""
    if name not in metrics:
        raise MetricError(f"metric {name} was not recorded")
    value = metrics[name]
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        raise MetricError(f"metric {name} is NaN or infinite")
    if huge_int(value):
        raise MetricError(f"metric {name} is an integer of {value.bit_length()} bits, too large for a float (over "
                          "1.8e308); record it as a float or a smaller unit")
    return value


def huge_int(value) -> bool:
    """An int (record() keeps Python ints as they are) beyond float range: arithmetic with floats overflows."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max


@dataclass(frozen=True)
class Expectation:
    """A parsed expectation; `holds(value, metrics)` tests a metric's value against it."""

    text: str
    kind: str                       # one of the comparison operators, 'within', 'between'
    args: tuple                     # expression trees (and the tolerance for 'within')
    names: frozenset = field(default=frozenset())  # other metrics it refers to

    def holds(self, value, metrics: dict) -> bool:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            raise MetricError("value is NaN or infinite")
        if huge_int(value):
            raise MetricError(f"value is an integer of {value.bit_length()} bits, too large for a float (over 1.8e308)")
        try:
            if self.kind in _COMPARE:
                return bool(_COMPARE[self.kind](value, _value(self.args[0], metrics)))
            if self.kind == "between":
                low, high = (_value(a, metrics) for a in self.args)
                return bool(low <= value <= high)
            tol, relative, target = self.args  # 'within'
            x = _value(target, metrics)
            bound = tol * abs(x) if relative else tol
            if isinstance(bound, float) and not math.isfinite(bound):
                raise MetricError(f"the tolerance of {self.text!r} overflows to {bound}")
            return bool(abs(value - x) <= bound)
        except (TypeError, OverflowError) as e:  # a string metric compared with '<'; int arithmetic past 1.8e308
            raise MetricError(f"cannot evaluate {self.text!r} for value {value!r}: {e}") from None


def _constant(node):
    """The number an expression tree evaluates to without metrics, or None when it names a metric."""
    if node[0] == "num":
        return node[1] if isinstance(node[1], (int, float)) and not isinstance(node[1], bool) else None
    if node[0] == "metric":
        return None
    left, right = _constant(node[1]), _constant(node[2])
    return None if left is None or right is None else _ARITH[node[0]](left, right)


def covers(expect: Expectation, low: float, high: float) -> bool:
    """True when `expect` holds for every value in [low, high] (a claim on a metric of that range that cannot
    fail); False when some value fails it or when it refers to other metrics (not decidable from the text)."""
    if expect.names:
        return False
    if expect.kind in ("<", "<=", ">", ">="):
        x = _constant(expect.args[0])
        edge = high if expect.kind in ("<", "<=") else low
        return x is not None and bool(_COMPARE[expect.kind](edge, x))
    if expect.kind == "between":
        a, b = (_constant(arg) for arg in expect.args)
        return a is not None and b is not None and a <= low and high <= b
    if expect.kind == "within":
        tol, relative, target = expect.args
        x = _constant(target)
        if x is None:
            return False
        tol = tol * abs(x) if relative else tol
        return x - tol <= low and high <= x + tol
    x = _constant(expect.args[0])  # '==': only a range of one point
    return x is not None and low == high == x


def parse_expectation(text: str) -> Expectation:
    """Parse an expectation string; raises ExpectationError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ExpectationError(f"an expectation must be a non-empty string such as '< 0.5', got {text!r}")
    p = _Parser(text)
    kind, tok = p.peek()
    if tok in _COMPARE:
        p.take()
        args = (p.expr(),)
    elif tok == "between":
        p.take()
        low = p.expr()
        p.take("and")
        args = (low, p.expr())
    elif tok == "within":
        p.take()
        k, num = p.take()
        if k != "num" or not math.isfinite(float(num)):
            raise ExpectationError(f"'within' needs a finite number tolerance in expectation {_short(text)}, got "
                                   f"{num!r}")
        relative = p.peek()[1] == "%"
        if relative:
            p.take()
        p.take("of")
        args = (float(num) / 100 if relative else float(num), relative, p.expr())
        tok = "within"
    else:
        raise ExpectationError(
            f"expectation {text!r} must start with <, <=, >, >=, ==, 'within' or 'between'")
    p.end()
    trees = [a for a in args if isinstance(a, tuple)]
    for tree in trees:
        _check_finite(tree, text)
    return Expectation(text.strip(), tok, args, frozenset().union(*map(_names, trees)))
