"""The hit-rule language of profiles: matched tokens as an expression of the prompt.

``connector.hit_rule``, ``hit_rules[].rule`` and ``granularity`` are expressions over
``len``, ``B`` (tokens) and numeric ``kv_connector_extra_config`` keys; e.g. vLLM's
ExampleConnector: ``0 if (len - 1) % B == 0 else (len - 2) // B * B``. Parsed with
``ast`` and walked by a small evaluator (nothing executed), with bounded size. Errors
are ``ValueError``/``SyntaxError`` naming the element, or ``ZeroDivisionError``/
``OverflowError``; :mod:`tvc.config.profile` names the key.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from typing import Any

MAX_RULE_CHARS = 2000  # characters of one expression
MAX_RULE_NODES = 200  # elements (names, numbers, operations) of one expression
MAX_RULE_NESTING = 32  # parentheses: Python's parser recurses per level
MAX_INT = 2**63 - 1  # integer literals: the signed 64-bit range


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 20 else f"{text[:20]}… ({len(text)} chars)"


_RULE_BINOPS: dict[type, Any] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}
_RULE_CMPOPS: dict[type, Any] = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
}
_RULE_FUNCS = {"min": min, "max": max}
_RULE_ALLOWED = ("allowed: integers, len, B, numeric extra_config keys, + - * // %, "
                 "min(), max(), comparisons, a if cond else b")
# AST helper nodes that are not counted as expression nodes
_RULE_UNCOUNTED = (ast.expr_context, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)


@functools.lru_cache(maxsize=256)
def _compile_rule(expr: str, names: frozenset[str]) -> ast.Expression:
    """Parse and validate a rule; raise ValueError/SyntaxError naming what is wrong."""
    if len(expr) > MAX_RULE_CHARS:
        raise ValueError(f"{len(expr)} characters, over the limit of {MAX_RULE_CHARS}")
    depth = deepest = 0
    for ch in expr:  # Python's parser recurses per parenthesis
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    if deepest > MAX_RULE_NESTING:
        raise ValueError(f"parentheses nested {deepest} deep, over {MAX_RULE_NESTING}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (RecursionError, MemoryError):
        raise ValueError("too deeply nested") from None
    count = 0
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, (*_RULE_UNCOUNTED, ast.Expression)) or id(node) in called:
            continue  # a call's function name is checked with the call
        count += 1
        if count > MAX_RULE_NODES:
            raise ValueError(f"over {MAX_RULE_NODES} elements (names, numbers, "
                             "operations)")
        _check_rule_node(node, names)
    return tree


def _check_rule_node(node: ast.AST, names: frozenset[str]) -> None:
    """Raise ValueError unless ``node`` belongs to the hit-rule language."""
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise ValueError(f"unsupported element {_short(node.value)} "
                             f"({_RULE_ALLOWED})")
        if abs(node.value) > MAX_INT:
            raise ValueError(f"integer {_short(node.value)} is outside the "
                             "64-bit range")
        return
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ValueError(f"unknown name {node.id!r} (variables: "
                             f"{', '.join(sorted(names))})")
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _RULE_BINOPS:
        _numeric(node.left, node.right)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        _numeric(node.operand)
        return
    if isinstance(node, ast.Compare) and all(type(o) in _RULE_CMPOPS
                                             for o in node.ops):
        return
    if isinstance(node, ast.IfExp):
        if not _is_condition(node.test):
            raise ValueError("the condition of 'a if cond else b' must be a "
                             "comparison, e.g. (len - 1) % B == 0")
        _numeric(node.body, node.orelse)
        return
    if isinstance(node, ast.BoolOp) and all(_is_condition(v) for v in node.values):
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) \
            and _is_condition(node.operand):
        return
    if isinstance(node, ast.Call):
        if (isinstance(node.func, ast.Name) and node.func.id in _RULE_FUNCS
                and not node.keywords and len(node.args) >= 2
                and not any(isinstance(a, ast.Starred) for a in node.args)):
            _numeric(*node.args)
            return
        raise ValueError(f"unsupported call ({_RULE_ALLOWED}; min and max take two "
                         "or more arguments)")
    what = type(getattr(node, "op", node)).__name__
    raise ValueError(f"unsupported element {what} ({_RULE_ALLOWED})")


def _numeric(*nodes: ast.AST) -> None:
    """Raise ValueError when a comparison stands where a number of tokens belongs."""
    if any(_is_condition(n) for n in nodes):
        raise ValueError("a comparison can only be the condition of "
                         "'a if cond else b'")


def _is_condition(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.BoolOp):
        return all(_is_condition(v) for v in node.values)
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) \
        and _is_condition(node.operand)


def _rule_value(node: ast.AST, env: Mapping[str, int | float]) -> Any:
    """Evaluate a validated rule node (depth <= MAX_RULE_NODES)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.Call):
        fn = _RULE_FUNCS[node.func.id]  # type: ignore[attr-defined]
        return fn(*(_rule_value(a, env) for a in node.args))
    if isinstance(node, ast.BinOp):
        return _RULE_BINOPS[type(node.op)](_rule_value(node.left, env),
                                           _rule_value(node.right, env))
    if isinstance(node, ast.UnaryOp):
        v = _rule_value(node.operand, env)
        return -v if isinstance(node.op, ast.USub) else (
            not v if isinstance(node.op, ast.Not) else v)
    if isinstance(node, ast.Compare):
        left = _rule_value(node.left, env)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _rule_value(comp, env)
            if not _RULE_CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        values = (_rule_value(v, env) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.IfExp):
        branch = node.body if _rule_value(node.test, env) else node.orelse
        return _rule_value(branch, env)
    raise ValueError(f"unsupported element {type(node).__name__}")  # pragma: no cover


def evaluate(expr: str, n: int, b: int,
               variables: Mapping[str, int | float] | None = None) -> int:
    """Evaluate a hit-rule expression at ``len = n``, ``B = b``, truncated to an int.

    Integer literals (64-bit), ``len``, ``B``, ``variables`` (``len`` and ``B`` win);
    ``+ - * // %``, unary ``-``, ``min``, ``max``, ``a if cond else b`` with comparisons
    and ``and``/``or``/``not``; at most :data:`MAX_RULE_NODES` elements.

    Raises:
        ValueError, SyntaxError: not an expression of the language.
        ZeroDivisionError: ``//`` or ``%`` by zero at these values.
        OverflowError: a float operand overflowed.

    """
    env: dict[str, int | float] = {**(variables or {}), "len": n, "B": b}
    tree = _compile_rule(expr, frozenset(env))
    _numeric(tree.body)
    return int(_rule_value(tree.body, env))


def rule_variables(extra_config: Mapping[str, Any]) -> dict[str, int | float]:
    """The numeric top-level ``extra_config`` keys a hit rule may name.

    Identifier keys (not ``len``, ``B``, ``min``, ``max``) with int or float (not bool)
    values.
    """
    return {k: v for k, v in extra_config.items()
            if isinstance(k, str) and k.isidentifier()
            and k not in ("len", "B", *_RULE_FUNCS)
            and isinstance(v, int | float) and not isinstance(v, bool)}
