"""One error hierarchy for the service; the API maps each to RFC 9457 problem+json.

Every error carries a stable machine-readable ``code``, an HTTP ``status``, a
human ``title`` and ``detail``, and optional extra members (``errors`` for a
list of field problems).

One base per kind of answer, each carrying its status and its generic problem
(code and title); a concrete error subclasses the base of its kind and names its own
``code`` and ``title``. :data:`KINDS` lists the bases; ``api.problems`` maps by kind.

| base | status |
| --- | --- |
| :class:`InvalidInputError` (field problems: :class:`InvalidFieldsError`) | 422 |
| :class:`UnauthenticatedError` | 401 |
| :class:`ForbiddenError` | 403 |
| :class:`NotFoundError` | 404 |
| :class:`ConflictError` | 409 |
| :class:`NotInstalledError` | 501 |
| :class:`UpstreamError` | 502 |
| :class:`UnavailableError` | 503 (retry: ``retry_after_s``) |
"""

from __future__ import annotations

from typing import Any, Self


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


# ------------------------------------------------------------------ the kinds


class InvalidInputError(VlabError):
    """The request cannot be done as asked (422)."""

    status = 422
    code = "invalid_input"
    title = "Invalid input"


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


class NotFoundError(VlabError):
    """No such thing (404)."""

    status = 404
    code = "not_found"
    title = "Not found"


class ConflictError(VlabError):
    """The thing is not in a state that allows the request (409)."""

    status = 409
    code = "conflict"
    title = "Conflict"


class NotInstalledError(VlabError):
    """An optional part of the service is not installed (501)."""

    status = 501
    code = "not_installed"
    title = "Not installed"


class UpstreamError(VlabError):
    """A server the service talks to failed or cannot be reached (502)."""

    status = 502
    code = "upstream_error"
    title = "Upstream server failed"


class UnavailableError(VlabError):
    """The service cannot do it now; a retry may succeed (503, ``retry_after_s`` when
    known)."""

    status = 503
    code = "unavailable"
    title = "Service unavailable"


#: The base of each kind, as the API maps them.
KINDS: tuple[type[VlabError], ...] = (
    InvalidInputError,
    UnauthenticatedError,
    ForbiddenError,
    NotFoundError,
    ConflictError,
    NotInstalledError,
    UpstreamError,
    UnavailableError,
)


# ------------------------------------------------------------------ 422


class RequestInvalidError(InvalidInputError):
    """The request does not parse (the framework's validation, extra member ``errors``),
    or holds what nothing can store (code ``nul_character``)."""

    code = "request_invalid"
    title = "Invalid request"


class InvalidFieldsError(InvalidInputError):
    """Invalid input listing every bad field in ``errors``.

    Each entry: ``{"loc": [...path...], "msg": str, "type": str}``.
    """

    #: What the problems are in, for the detail ("3 problem(s) in the experiment spec: ...").
    subject = "the request"

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
    def from_validation(cls, exc: Any) -> Self:
        """From a :class:`pydantic.ValidationError`, locations prefixed with ``body``."""
        return cls(
            [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        )


class SpecInvalidError(InvalidFieldsError):
    """The experiment spec is invalid (or names a model nothing resolves); ``errors``
    lists every bad field."""

    code = "spec_invalid"
    title = "Invalid experiment spec"
    subject = "the experiment spec"


class ScheduleInvalidError(InvalidFieldsError):
    """A schedule is invalid (bad cron expression, time zone, or template).

    Template problems keep the experiment spec's locations under
    ``["body", "template", ...]``.
    """

    code = "schedule_invalid"
    title = "Invalid schedule"
    subject = "the experiment spec"


class CampaignInvalidError(InvalidFieldsError):
    """A tuning campaign request is invalid (``POST /api/v1/campaigns``): its schema, its
    space (variables, levels, the starting level), its objective, a budget too small, or
    the experiment its first round would submit; ``errors`` lists every bad field."""

    code = "campaign_invalid"
    title = "Invalid campaign"
    subject = "the campaign"


class ParityRequestInvalidError(InvalidFieldsError):
    """An on-demand parity check request is invalid (``POST /api/v1/cluster/parity``):
    unknown engine arguments, node ids no live orchestrator knows, a TP x PP shape
    those nodes cannot hold, an unknown model.
    """

    code = "parity_request_invalid"
    title = "Invalid parity check request"
    subject = "the experiment spec"


class QueryInvalidError(InvalidFieldsError):
    """A query parameter of a list endpoint cannot be applied (e.g. ``engine_arg``
    without ``=``), located at ``["query", <name>]``."""

    code = "query_invalid"
    title = "Invalid query parameter"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(
            [{"loc": ["query", field], "msg": message, "type": "value_error"}],
            detail=f"query parameter {field}: {message}",
        )


class AnalyzeRequestInvalidError(InvalidFieldsError):
    """A ``/api/v1/analyze/*`` request cannot be answered (unknown model, missing
    figures)."""

    code = "analyze_request_invalid"
    title = "Invalid analysis request"
    subject = "the experiment spec"


class ExportRequestInvalidError(InvalidFieldsError):
    """An export cannot be done as asked (``POST /api/v1/experiments/{id}/export/mlflow``):
    no tracking URI, or one the API does not accept (only ``http(s)`` unless
    ``VLAB_MLFLOW__ALLOW_LOCAL_STORES``; only the ``VLAB_MLFLOW__ALLOWED_URI_PREFIXES``
    when set)."""

    code = "export_request_invalid"
    title = "Invalid export request"


# ------------------------------------------------------------------ tokens (several kinds)


class TokenError(VlabError):
    """A token cannot be created or revoked as asked: the family of
    :class:`TokenInvalidError` (422), :class:`TokenNotFoundError` (404) and
    :class:`TokenNameTakenError` (409); the status comes from the kind."""


class TokenInvalidError(TokenError, InvalidInputError):
    """A bad token name or role."""

    code = "token_invalid"
    title = "Invalid token request"


class TokenNotFoundError(TokenError, NotFoundError):
    """No token has that id, key id or name."""

    code = "token_not_found"
    title = "No such token"


class TokenNameTakenError(TokenError, ConflictError):
    """An active token already has that name."""

    code = "token_name_taken"
    title = "Token name taken"


# ------------------------------------------------------------------ 409


class InvalidTransitionError(ConflictError):
    code = "invalid_transition"
    title = "Invalid run state transition"


class MlflowExperimentDeletedError(ConflictError):
    """The MLflow experiment of that name exists but is deleted: restore it in MLflow
    or export under another name."""

    code = "mlflow_experiment_deleted"
    title = "MLflow experiment deleted"


# ------------------------------------------------------------------ 501, 502


class MlflowNotInstalledError(NotInstalledError):
    """The ``mlflow`` package (the ``mlflow`` extra: ``pip install 'vlab[mlflow]'``) is
    not installed in the service's environment."""

    code = "mlflow_not_installed"
    title = "MLflow export not installed"


class MlflowUnreachableError(UpstreamError):
    """The MLflow tracking server cannot be reached (connection refused, DNS, timeout)."""

    code = "mlflow_unreachable"
    title = "MLflow tracking server unreachable"


class MlflowExportError(UpstreamError):
    """The MLflow tracking server or store refused or failed a request of the export
    (authentication, a limit, a store error); extra members say how far it got."""

    code = "mlflow_error"
    title = "MLflow export failed"


# ------------------------------------------------------------------ 503


class EngineUnavailableError(UnavailableError):
    code = "engine_unavailable"
    title = "Engine environment unavailable"


class SubmissionsBusyError(UnavailableError):
    """Too many submissions are being checked: retry after ``retry_after_s`` seconds
    (:class:`orchestrator.experiments.config_check.CheckGate`)."""

    code = "submissions_busy"
    title = "Too many submissions"


class DatabaseUnavailableError(UnavailableError):
    """The database cannot be reached (the API turns the driver's error into this)."""

    code = "database_unavailable"
    title = "Database unavailable"


class DatabaseBusyError(UnavailableError):
    """Every database connection is in use (the pool's timeout)."""

    code = "database_busy"
    title = "Database busy"


class RayClusterError(UnavailableError):
    """The Ray cluster named by ``RAY_ADDRESS`` cannot be used: a Ray Client address, a
    failed connection or token authentication, or nodes that lack what vlab's Ray tasks
    need (:mod:`orchestrator.dispatch.ray.join`); the detail is one line saying which
    node lacks what, or what to set."""

    code = "ray_cluster_unusable"
    title = "Ray cluster unusable"
