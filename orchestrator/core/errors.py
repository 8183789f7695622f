"""One error hierarchy for the service; the API maps each to RFC 9457 problem+json.

Every error carries a stable machine-readable ``code``, an HTTP ``status``, a
human ``title`` and ``detail``, and optional extra members (``errors`` for a
list of field problems).
"""

from __future__ import annotations

from typing import Any


class VlabError(Exception):
    status: int = 500
    code: str = "internal_error"
    title: str = "Internal error"

    def __init__(self, detail: str, *, code_hint: str | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra
        if code_hint:
            self.code = code_hint


class NotFoundError(VlabError):
    status = 404
    code = "not_found"
    title = "Not found"


class SpecInvalidError(VlabError):
    """The experiment spec is invalid; ``errors`` lists every bad field.

    Each entry: ``{"loc": [...path...], "msg": str, "type": str}``.
    """

    status = 422
    code = "spec_invalid"
    title = "Invalid experiment spec"
    #: What the problems are in, for the detail ("3 problem(s) in the experiment spec: ...").
    subject = "the experiment spec"

    #: Most problems listed in one answer (a body can hold thousands of bad fields).
    MAX_LISTED = 200

    def __init__(self, errors: list[dict[str, Any]], detail: str | None = None) -> None:
        if len(errors) > self.MAX_LISTED:
            more = len(errors) - self.MAX_LISTED
            errors = [
                *errors[: self.MAX_LISTED],
                {"loc": ["body"], "msg": f"... and {more} more problems", "type": "truncated"},
            ]
        summary = "; ".join(
            f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg', '')}" for e in errors[:5]
        )
        super().__init__(
            detail or f"{len(errors)} problem(s) in {self.subject}: {summary}",
            errors=errors,
        )
        self.errors = errors

    @classmethod
    def from_validation(cls, exc: Any) -> SpecInvalidError:
        """From a :class:`pydantic.ValidationError`, locations prefixed with ``body``."""
        return cls(
            [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        )


class ConflictError(VlabError):
    status = 409
    code = "conflict"
    title = "Conflict"


class InvalidTransitionError(ConflictError):
    code = "invalid_transition"
    title = "Invalid run state transition"


class EngineUnavailableError(VlabError):
    status = 503
    code = "engine_unavailable"
    title = "Engine environment unavailable"


class ScheduleInvalidError(SpecInvalidError):
    """A schedule is invalid (bad cron expression, time zone, or template).

    ``errors`` as in :class:`SpecInvalidError`; template problems keep the
    experiment spec's locations under ``["body", "template", ...]``.
    """

    code = "schedule_invalid"
    title = "Invalid schedule"


class ParityRequestInvalidError(SpecInvalidError):
    """An on-demand parity check request is invalid (``POST /api/v1/cluster/parity``).

    ``errors`` as in :class:`SpecInvalidError`: unknown engine arguments, node
    ids no live orchestrator knows, a TP x PP shape those nodes cannot hold,
    an unknown model.
    """

    code = "parity_request_invalid"
    title = "Invalid parity check request"


class QueryInvalidError(SpecInvalidError):
    """A query parameter of a list endpoint cannot be applied (e.g. ``engine_arg``
    without ``=``). ``errors`` as in :class:`SpecInvalidError`, located at
    ``["query", <name>]``."""

    code = "query_invalid"
    title = "Invalid query parameter"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(
            [{"loc": ["query", field], "msg": message, "type": "value_error"}],
            detail=f"query parameter {field}: {message}",
        )


class AnalyzeRequestInvalidError(SpecInvalidError):
    """A ``/api/v1/analyze/*`` request cannot be answered (unknown model, missing
    figures). ``errors`` as in :class:`SpecInvalidError`."""

    code = "analyze_request_invalid"
    title = "Invalid analysis request"


class UnauthenticatedError(VlabError):
    """No valid credentials: no ``Authorization: Bearer`` token, an unknown, revoked or
    expired one, or no dashboard session, while tokens are required. The API answers
    401 with ``WWW-Authenticate: Bearer``."""

    status = 401
    code = "unauthenticated"
    title = "Authentication required"


class ForbiddenError(VlabError):
    """Authenticated, but the token's role is below what the request needs (extra
    member ``required_role``), or a dashboard request without its CSRF token
    (code ``csrf_failed``)."""

    status = 403
    code = "forbidden"
    title = "Forbidden"


class TokenInvalidError(VlabError):
    """A token cannot be created or revoked as asked (bad name or role, a name an
    active token has, no such token)."""

    status = 422
    code = "token_invalid"
    title = "Invalid token request"


class TokenNotFoundError(TokenInvalidError):
    """No token has that id, key id or name."""

    status = 404
    code = "token_not_found"
    title = "No such token"


class TokenNameTakenError(TokenInvalidError):
    """An active token already has that name."""

    status = 409
    code = "token_name_taken"
    title = "Token name taken"


class ExportRequestInvalidError(SpecInvalidError):
    """An export cannot be done as asked (``POST /api/v1/experiments/{id}/export/mlflow``):
    no tracking URI, or one the API does not accept (only ``http(s)`` unless
    ``VLAB_MLFLOW__ALLOW_LOCAL_STORES``; only the ``VLAB_MLFLOW__ALLOWED_URI_PREFIXES``
    when set). ``errors`` as in :class:`SpecInvalidError`."""

    code = "export_request_invalid"
    title = "Invalid export request"
    subject = "the request"


class MlflowNotInstalledError(VlabError):
    """The ``mlflow`` package (the ``mlflow`` extra: ``pip install 'vlab[mlflow]'``) is
    not installed in the service's environment."""

    status = 501
    code = "mlflow_not_installed"
    title = "MLflow export not installed"


class MlflowUnreachableError(VlabError):
    """The MLflow tracking server cannot be reached (connection refused, DNS, timeout)."""

    status = 502
    code = "mlflow_unreachable"
    title = "MLflow tracking server unreachable"


class MlflowExportError(VlabError):
    """The MLflow tracking server or store refused or failed a request of the export
    (authentication, a limit, a store error); extra members say how far it got."""

    status = 502
    code = "mlflow_error"
    title = "MLflow export failed"


class MlflowExperimentDeletedError(ConflictError):
    """The MLflow experiment of that name exists but is deleted: restore it in MLflow
    or export under another name."""

    code = "mlflow_experiment_deleted"
    title = "MLflow experiment deleted"


class RayClusterError(VlabError):
    """The Ray cluster named by ``RAY_ADDRESS`` cannot be used: a Ray Client address, a
    failed connection or token authentication, or nodes that lack what vlab's Ray tasks
    need (:mod:`orchestrator.dispatch.ray.join`); the detail is one line saying which
    node lacks what, or what to set."""

    status = 503
    code = "ray_cluster_unusable"
    title = "Ray cluster unusable"
