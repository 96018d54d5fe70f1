"""What the API server does with a CRD schema, done here so tests can check it offline.

- :func:`structural_problems`: the structural-schema rules apiextensions/v1 enforces.
- :func:`admit`: default, then validate an object the way ``kubectl apply`` would —
  OpenAPI checks through ``jsonschema`` and the ``x-kubernetes-validations`` CEL rules
  through ``cel-python``, with the Kubernetes quantity library supplied from
  :mod:`kvshare.api.quantity`. Returns the messages the API server would return.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from kvshare.api.quantity import QuantityError, QuantityTooLargeError, parse_quantity

_ANY_OF_ALLOWED = {"x-kubernetes-int-or-string"}


def structural_problems(schema: dict[str, Any], path: str = "") -> list[str]:
    """Violations of the structural-schema rules, one message per violation."""
    problems = []
    where = path or "<root>"
    for forbidden in ("$ref", "definitions", "$defs", "title", "nullable"):
        if forbidden in schema:
            problems.append(f"{where}: {forbidden} is not allowed")
    special = schema.get("x-kubernetes-int-or-string") or schema.get(
        "x-kubernetes-preserve-unknown-fields"
    )
    if "type" not in schema and not special:
        problems.append(f"{where}: has no type")
    for combinator in ("anyOf", "allOf", "oneOf", "not"):
        if combinator in schema and not _ANY_OF_ALLOWED & schema.keys():
            problems.append(f"{where}: {combinator} is only allowed for int-or-string")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{where}: properties and additionalProperties are exclusive")
    if isinstance(schema.get("additionalProperties"), bool):
        problems.append(f"{where}: additionalProperties must be a schema")
    for name, prop in schema.get("properties", {}).items():
        problems += structural_problems(prop, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        problems += structural_problems(schema["items"], f"{path}[]")
    for rule in schema.get("x-kubernetes-validations", []):
        if "message" not in rule and "messageExpression" not in rule:
            problems.append(f"{where}: CEL rule without a message")
    return problems


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """A copy of ``obj`` with the schema's defaults filled in, as the API server does."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in schema:
        for name, prop in schema["properties"].items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = apply_defaults(prop, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


class _Quantity(celtypes.DoubleType):
    """Exactness is not needed to compare sizes in tests; the parser is the real one."""


def _quantity(text: Any) -> _Quantity:
    try:
        return _Quantity(float(parse_quantity(str(text))))
    except QuantityTooLargeError:  # Kubernetes parses it (a big decimal): larger than all
        return _Quantity(math.inf)


def _is_int64(value: float) -> bool:
    return math.isfinite(value) and value == int(value) and abs(value) < 2**63


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        parse_quantity(str(text))
    except QuantityTooLargeError:
        return celtypes.BoolType(True)
    except QuantityError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _compare_to(left: Any, right: Any) -> celtypes.IntType:
    return celtypes.IntType((left > right) - (left < right))


def _index_of(text: Any, sub: Any) -> celtypes.IntType:
    return celtypes.IntType(str(text).find(str(sub)))


def _substring(text: Any, start: Any, end: Any = None) -> celtypes.StringType:
    return celtypes.StringType(str(text)[int(start) : None if end is None else int(end)])


def _replace(text: Any, old: Any, new: Any) -> celtypes.StringType:
    return celtypes.StringType(str(text).replace(str(old), str(new)))


def _join(items: Any, separator: Any = "") -> celtypes.StringType:
    return celtypes.StringType(str(separator).join(str(item) for item in items))


#: CEL functions the Kubernetes API server adds: its quantity library and the string
#: extensions (indexOf, substring, replace, join) its rules may use.
_CEL_FUNCTIONS = {
    "indexOf": _index_of,
    "substring": _substring,
    "replace": _replace,
    "join": _join,
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "sign": lambda q: celtypes.IntType((float(q) > 0) - (float(q) < 0)),
    "isInteger": lambda q: celtypes.BoolType(_is_int64(float(q))),
    "compareTo": _compare_to,
    "isLessThan": lambda a, b: celtypes.BoolType(a < b),
    "isGreaterThan": lambda a, b: celtypes.BoolType(a > b),
}
_ENV = celpy.Environment()


def _cel_messages(schema: dict[str, Any], obj: Any) -> list[str]:
    messages = []
    for rule in schema.get("x-kubernetes-validations", []):
        activation = {"self": celpy.json_to_cel(obj)}
        program = _ENV.program(_ENV.compile(rule["rule"]), functions=_CEL_FUNCTIONS)
        verdict = program.evaluate(activation)
        if isinstance(verdict, celpy.CELEvalError):
            raise AssertionError(f"CEL rule {rule['rule']!r} failed to evaluate: {verdict}")
        if not verdict:
            if "messageExpression" in rule:
                expression = _ENV.compile(rule["messageExpression"])
                message = _ENV.program(expression, functions=_CEL_FUNCTIONS).evaluate(activation)
                messages.append(str(message))
            else:
                messages.append(rule["message"])
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in obj:
                messages += _cel_messages(prop, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            messages += _cel_messages(schema["items"], item)
    return messages


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """What ``kubectl apply`` of ``obj`` against ``crd`` would report; [] when accepted."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(defaulted), key=lambda e: list(e.absolute_path))
    if errors:
        # The API server stops at schema errors before running CEL rules.
        return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors]
    return _cel_messages(schema, defaulted)
