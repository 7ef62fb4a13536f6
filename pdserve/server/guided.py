"""Structured-output request fields read into one ``GrammarSpec``: OpenAI's
``response_format``, vLLM's ``guided_*`` fields and its ``structured_outputs`` object.

A request may ask for one grammar; each is checked here (llguidance, imported on the first
grammar), so a bad schema, regex or grammar is a 400 naming its field before the engine sees
the request.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pdserve.sampling_params import GrammarSpec, InvalidRequestError
from pdserve.server.protocol import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUT_KEYS = {"json": "json", "regex": "regex", "choice": "choice",
                          "grammar": "grammar", "json_object": "json_object"}
ANY_JSON_OBJECT = '{"type": "object"}'


def read_grammar(body: dict) -> GrammarSpec | None:
    """The request's grammar, checked; None when it asks for none."""
    specs = [spec for spec in (_response_format(body.get("response_format")),
                               *(_guided(body, name) for name in GUIDED_FIELDS),
                               _structured_outputs(body.get("structured_outputs")))
             if spec is not None]
    if len(specs) > 1:
        raise bad_request(f"'{specs[1].field}' and '{specs[0].field}' both constrain the "
                          "output; send one of them", param=specs[1].field)
    spec = _with_whitespace(specs[0] if specs else None, body.get("guided_whitespace_pattern"))
    if spec is not None:
        check(spec)
    return spec


def _with_whitespace(spec: GrammarSpec | None, pattern: Any) -> GrammarSpec | None:
    """vLLM's ``guided_whitespace_pattern``: the whitespace a JSON output may have between
    its tokens, a regular expression (llguidance's ``whitespace_pattern``), in place of
    the compact JSON sampled otherwise."""
    field = "guided_whitespace_pattern"
    if pattern is None:
        return spec
    if not isinstance(pattern, str):
        raise bad_request(f"'{field}' must be a string (a regular expression)", param=field)
    if spec is None or spec.kind != "json":
        raise bad_request(f"'{field}' shapes JSON output: it needs a JSON schema "
                          "(guided_json, response_format or structured_outputs.json)",
                          param=field)
    schema = json.loads(spec.source)
    options = {**schema.get("x-guidance", {}), "whitespace_flexible": True,
               "whitespace_pattern": pattern}
    return replace(spec, source=json.dumps({**schema, "x-guidance": options}))


def check(spec: GrammarSpec) -> None:
    """A 400 naming ``spec.field`` when the grammar is invalid or llguidance is missing."""
    from pdserve.structured.grammars import check_grammar

    try:
        check_grammar(spec)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=spec.field) from None


def _response_format(value: Any) -> GrammarSpec | None:
    field = "response_format"
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json", ANY_JSON_OBJECT, field)
    if kind != "json_schema":
        raise bad_request("'response_format.type' must be 'text', 'json_object' or "
                          "'json_schema'", param=field)
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
        raise bad_request("'response_format.json_schema' must be an object whose 'schema' is "
                          "a JSON schema object", param=field)
    if not isinstance(inner.get("strict", False), (bool, type(None))):
        raise bad_request("'response_format.json_schema.strict' must be a boolean", param=field)
    # Strict or not, the output always follows the schema: it is sampled under its grammar.
    return GrammarSpec("json", json.dumps(inner.get("schema", {"type": "object"})), field)


def _guided(body: dict, name: str) -> GrammarSpec | None:
    value = body.get(name)
    return None if value is None else _spec(GUIDED_FIELDS[name], value, name)


def _structured_outputs(value: Any) -> GrammarSpec | None:
    field = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"'{field}' must be an object", param=field)
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUT_KEYS))
    if unknown:
        raise bad_request(f"'{field}.{unknown[0]}' is not supported; it takes one of "
                          f"{', '.join(STRUCTURED_OUTPUT_KEYS)}", param=field)
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise bad_request(f"'{field}' must set exactly one of "
                          f"{', '.join(STRUCTURED_OUTPUT_KEYS)}", param=field)
    key, inner = next(iter(given.items()))
    if key == "json_object":
        return GrammarSpec("json", ANY_JSON_OBJECT, field)
    return _spec(STRUCTURED_OUTPUT_KEYS[key], inner, field)


def _spec(kind: str, value: Any, field: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec(kind, _schema_text(value, field), field)
    if kind == "choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"'{field}' must be a non-empty list of non-empty strings",
                              param=field)
        return GrammarSpec(kind, json.dumps(value), field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{field}' must be a non-empty string", param=field)
    return GrammarSpec(kind, value, field)


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"'{field}' is not valid JSON: {exc}", param=field) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{field}' must be a JSON schema object", param=field)
    return json.dumps(value)
