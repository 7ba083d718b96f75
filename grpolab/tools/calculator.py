"""A safe, exact arithmetic calculator for a language-model tool call.

The expression is read by this module's own tokenizer and recursive-descent parser (no ``eval``,
``exec``, ``compile`` or ``ast``; no names, attributes or calls) and evaluated exactly with
``fractions.Fraction``. A refusal is a ``CalculatorError`` with a short message for the model that
never echoes more than 20 characters of the input. The bounds keep the work per call tiny:

- at most ``MAX_INPUT_CHARS`` characters, checked first; then only ASCII ``0-9 . + - * / % ^ ( )``,
  space and tab, checked before parsing;
- at most ``MAX_DEPTH`` nested parentheses, signs and exponents (so recursion stays shallow);
- every literal, intermediate and result has ``|x| <= MAX_MAGNITUDE`` and a reduced denominator
  of at most ``MAX_DENOMINATOR``;
- an exponent is a whole number with ``|e| <= MAX_EXPONENT``, and a power is bounded from bit
  lengths before it is computed, so ``9^9^9`` is refused at once;
- a ``TIME_LIMIT_S`` deadline, checked while parsing, is a last line of defence only.

Grammar, lowest precedence first; as in Python ``-2^2 = -4``, ``2^-1 = 0.5``, ``2^3^2 = 512``::

    expr  := term (('+' | '-') term)*
    term  := unary (('*' | '/' | '//' | '%') unary)*
    unary := ('+' | '-') unary | power
    power := atom (('^' | '**') unary)?
    atom  := number | '(' expr ')'          number := digits with at most one '.', e.g. 12 3.5 .5 7.
"""

from __future__ import annotations

import time
from fractions import Fraction

MAX_INPUT_CHARS = 200
MAX_DEPTH = 32
MAX_MAGNITUDE = 10**15
MAX_DENOMINATOR = 10**12
MAX_EXPONENT = 64
TIME_LIMIT_S = 0.05
DECIMALS = 10

CALCULATOR_DESCRIPTION = (
    "Evaluate an arithmetic expression exactly (numbers, + - * / // % ^ and parentheses) and return the result."
)
CALCULATOR_SCHEMA = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "Arithmetic with numbers such as 12 or 3.5, the operators + - * / // % ^ (or **) "
            "and parentheses, e.g. (12+3)*4/5",
            "maxLength": MAX_INPUT_CHARS,
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}

_DIGITS = frozenset("0123456789")
_ALLOWED = _DIGITS | frozenset(".+-*/%^() \t")
_SEPARATORS = "write numbers without thousands separators"
_HINTS = {
    ",": _SEPARATORS,
    "_": _SEPARATORS,
    "\u2212": "use '-'",
    "\u00d7": "use '*'",
    "\u00f7": "use '/'",
    "\u00b2": "use ^2",
    "\u00b3": "use ^3",
}
_TOO_LARGE = "too large (limit 10^15 in absolute value)"
_TOO_PRECISE = "too precise (denominator above 10^12)"

Token = tuple[str, object, int]  # kind ('num', 'op' or 'end'), value, 1-based position


class CalculatorError(ValueError):
    """The expression was refused; the message is short and safe to show the model."""


def _refuse_character(char: str, pos: int) -> CalculatorError:
    hint = _HINTS.get(char) or (
        "use ASCII digits 0-9"
        if char.isdigit()
        else "separate tokens with ASCII spaces"
        if char.isspace()
        else "use only digits, '.', + - * / // % ^ ( ) and spaces"
    )
    return CalculatorError(f"character U+{ord(char):04X} (position {pos}) is not allowed; {hint}")


def _bounded(x: Fraction, what: str = "result") -> Fraction:
    if abs(x) > MAX_MAGNITUDE:
        raise CalculatorError(f"{what} {_TOO_LARGE}")
    if x.denominator > MAX_DENOMINATOR:
        raise CalculatorError(f"{what} {_TOO_PRECISE}")
    return x


def _tokenize(text: str) -> list[Token]:
    """One linear pass over already-checked characters."""
    tokens: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t":
            i += 1
        elif c in _DIGITS or c == ".":
            start = i
            while i < n and (text[i] in _DIGITS or text[i] == "."):
                i += 1
            whole, _, frac = text[start:i].partition(".")
            if "." in frac or not (whole or frac):
                raise CalculatorError(f"malformed number at position {start + 1}; use at most one '.'")
            scale = 10 ** len(frac)
            value = Fraction(int(whole or "0") * scale + int(frac or "0"), scale)
            tokens.append(("num", _bounded(value, "number"), start + 1))
        elif text.startswith(("//", "**"), i):
            tokens.append(("op", text[i : i + 2], i + 1))
            i += 2
        else:
            tokens.append(("op", c, i + 1))
            i += 1
    tokens.append(("end", None, n + 1))
    return tokens


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent``, refusing results out of bounds before computing them."""
    if exponent.denominator != 1:
        raise CalculatorError("the exponent must be a whole number")
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponent too large (limit {MAX_EXPONENT} in absolute value)")
    num, den = base.numerator, base.denominator
    if e < 0:
        if num == 0:
            raise CalculatorError("zero cannot be raised to a negative power")
        num, den, e = den, num, -e
    # x^e >= 2^((bits(x) - 1) * e) and 2^bits(m) > m: so the powers computed below are small.
    if (abs(den).bit_length() - 1) * e >= MAX_DENOMINATOR.bit_length() or abs(den**e) > MAX_DENOMINATOR:
        raise CalculatorError(f"result {_TOO_PRECISE}")
    if (abs(num).bit_length() - 1) * e >= (MAX_MAGNITUDE * MAX_DENOMINATOR).bit_length():
        raise CalculatorError(f"result {_TOO_LARGE}")
    return _bounded(Fraction(num**e, den**e))


class _Parser:
    """Recursive descent over the tokens, evaluating as it goes."""

    def __init__(self, tokens: list[Token], deadline: float):
        self.tokens, self.i, self.depth, self.deadline = tokens, 0, 0, deadline

    def take(self, *ops: str) -> str | None:
        kind, value, _ = self.tokens[self.i]
        if kind == "op" and value in ops:
            self.i += 1
            return value  # type: ignore[return-value]
        return None

    def unexpected(self) -> CalculatorError:
        kind, value, pos = self.tokens[self.i]
        if kind == "end":
            return CalculatorError("unexpected end of expression")
        if value == ")" and self.depth == 0:
            return CalculatorError(f"unmatched ')' at position {pos}")
        return CalculatorError(f"unexpected {'number' if kind == 'num' else repr(value)} at position {pos}")

    def nested(self, parse) -> Fraction:
        """``parse()`` one level deeper in parentheses, signs or exponents."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested too deeply (limit {MAX_DEPTH})")
        value = parse()
        self.depth -= 1
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while op := self.take("+", "-"):
            right = self.term()
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while op := self.take("*", "/", "//", "%"):
            right = self.unary()
            if op != "*" and right == 0:
                raise CalculatorError("modulo by zero" if op == "%" else "division by zero")
            if op == "*":
                value = _bounded(value * right)
            elif op == "/":
                value = _bounded(value / right)
            else:
                value = _bounded(Fraction(value // right) if op == "//" else value % right)
        return value

    def unary(self) -> Fraction:
        if time.perf_counter() > self.deadline:
            raise CalculatorError("expression took too long to evaluate")
        if op := self.take("+", "-"):
            value = self.nested(self.unary)
            return -value if op == "-" else value
        base = self.atom()
        return _power(base, self.nested(self.unary)) if self.take("^", "**") else base

    def atom(self) -> Fraction:
        kind, value, pos = self.tokens[self.i]
        if kind == "num":
            self.i += 1
            return value  # type: ignore[return-value]
        if not self.take("("):
            raise self.unexpected()
        value = self.nested(self.expr)
        if not self.take(")"):
            if self.tokens[self.i][0] == "end":
                raise CalculatorError(f"missing ')' for the '(' at position {pos}")
            raise self.unexpected()
        return value


def _format(x: Fraction) -> str:
    """An integer as an integer, else at most 10 decimals (exact when it terminates), half-even."""
    scaled = round(x * 10**DECIMALS)  # Fraction.__round__ rounds half to even
    sign, scaled = ("-" if scaled < 0 else ""), abs(scaled)
    whole, frac = divmod(scaled, 10**DECIMALS)
    digits = f"{frac:0{DECIMALS}d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def calculate(expression: str) -> str:
    """Evaluate ``expression`` exactly and return the formatted result, or raise CalculatorError."""
    deadline = time.perf_counter() + TIME_LIMIT_S
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_INPUT_CHARS:
        raise CalculatorError(f"expression too long (limit {MAX_INPUT_CHARS} characters)")
    for pos, char in enumerate(expression, 1):
        if char not in _ALLOWED:
            raise _refuse_character(char, pos)
    if not expression.strip(" \t"):
        raise CalculatorError("empty expression")
    try:
        parser = _Parser(_tokenize(expression), deadline)
        value = parser.expr()
        if parser.tokens[parser.i][0] != "end":
            raise parser.unexpected()
        return _format(_bounded(value))
    except CalculatorError:
        raise
    except Exception:  # a bug must not escape as anything but a refusal
        raise CalculatorError("internal error") from None
