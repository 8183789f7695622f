"""The OpenAPI description tells the truth about errors: every problem+json answer declared.

FastAPI documents a route's success response and a 422 with its own
``HTTPValidationError`` shape as ``application/json``. The service answers every
error as RFC 9457 ``application/problem+json`` (:mod:`api.problems`), and some
errors can come from any route. :func:`declare_problems` adds to each operation
the answers it can give, all with the :data:`PROBLEM_SCHEMA` shape:

- every operation: 500 (``internal_error``);
- ``/api/...`` operations: 401 and 403 (tokens and roles, :mod:`api.auth`) and 503
  (``database_unavailable``, ``database_busy``);
- an operation with path parameters: 404;
- an operation with parameters or a body: 422 (replacing FastAPI's shape), and with a
  body also 413 (``payload_too_large``, :mod:`api.limits`);
- the submissions (``POST /experiments``, ``POST /runs/{id}/variants``, schedules):
  503 ``submissions_busy`` with ``Retry-After``, 409 where a conflict is possible.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from orchestrator.experiments.spec import ExperimentSpec

PROBLEM_JSON = "application/problem+json"

PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "type": "object",
    "description": "RFC 9457 problem details; `code` is stable and machine-readable",
    "required": ["type", "title", "status", "detail", "code"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
        "code": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                    "msg": {"type": "string"},
                    "type": {"type": "string"},
                },
            },
        },
    },
    "additionalProperties": True,
}

_DESCRIPTIONS = {
    "400": "Bad request (malformed)",
    "401": "No valid token or session (`unauthenticated`)",
    "403": "The role is too low, or the CSRF token is missing (`forbidden`, `csrf_failed`)",
    "404": "No such resource (`not_found`)",
    "405": "Method not allowed (with `Allow`)",
    "409": "Conflict with the resource's state",
    "413": "Request body too large (`payload_too_large`)",
    "422": "Invalid request: every bad field in `errors`",
    "500": "Internal error (`internal_error`, with an `error_id` for the log)",
    "503": "A dependency is down or busy (`database_unavailable`, `database_busy`, "
    "`submissions_busy`), with `Retry-After`",
}

#: Operations that submit work (vLLM's configuration check): busy -> 503, races -> 409.
_SUBMISSIONS = {
    ("post", "/api/v1/experiments"),
    ("post", "/api/v1/runs/{run_id}/variants"),
    ("post", "/api/v1/schedules"),
    ("patch", "/api/v1/schedules/{schedule_id}"),
}
_CONFLICTS = {
    ("post", "/api/v1/runs/{run_id}/cancel"),
    ("post", "/api/v1/runs/{run_id}/variants"),
    ("post", "/api/v1/tokens"),
}
_METHODS = ("get", "put", "post", "delete", "patch", "options", "head")


def _problem_response(code: str) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _DESCRIPTIONS.get(code, "Problem"),
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    if code in ("503", "429"):
        response["headers"] = {
            "Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}
        }
    if code == "401":
        response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return response


def declare_problems(doc: dict[str, Any]) -> dict[str, Any]:
    """Add the problem responses to every operation of ``doc`` (in place; returned)."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = PROBLEM_SCHEMA
    for path, item in doc.get("paths", {}).items():
        for method in _METHODS:
            op = item.get(method)
            if not isinstance(op, dict):
                continue
            responses = op.setdefault("responses", {})
            codes = {"500"}
            if (
                path.startswith("/api/") or path == "/healthz"
            ):  # health: 503 when a dependency is down
                codes |= {"503"}
            if path.startswith("/api/"):
                codes |= {"401", "403"}
            if "{" in path:
                codes.add("404")
            if op.get("parameters") or op.get("requestBody"):
                codes.add("422")
            if op.get("requestBody"):
                codes |= {"400", "413"}
            if (method, path) in _SUBMISSIONS:
                codes.add("503")
            if (method, path) in _CONFLICTS:
                codes.add("409")
            for code in sorted(codes):
                if code == "422" or code not in responses:
                    responses[code] = _problem_response(code)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return doc


#: ``ExperimentSpec`` (and its parts, under ``$defs``) as JSON Schema, for the components.
SPEC_SCHEMA = ExperimentSpec.model_json_schema(ref_template="#/components/schemas/{model}")


def install(app: FastAPI) -> None:
    """The application's OpenAPI document: ``ExperimentSpec`` (and its parts) published in
    the components (``POST /api/v1/experiments`` refers to it), and the problem answers
    of every operation (:func:`declare_problems`)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        spec = dict(SPEC_SCHEMA)
        for name, sub in spec.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas["ExperimentSpec"] = spec
        app.openapi_schema = declare_problems(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
