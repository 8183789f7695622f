"""``/openapi.json`` (a viewer may read it, like any other read of the API) and ``/docs``:
Swagger UI for it, from the vendored copy in ``web/static/vendor/swagger-ui``
(swagger-ui-dist 5.35.0), so the API docs work offline too. Signed-in like a dashboard
page."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response

from api import auth

router = APIRouter(include_in_schema=False)


@router.get("/openapi.json", dependencies=auth.API_AUTH)
def openapi_json(request: Request) -> JSONResponse:
    """The OpenAPI document (:mod:`api.openapi` adds the problem responses)."""
    return JSONResponse(request.app.openapi())


@router.get("/docs", dependencies=auth.PAGE_AUTH)
def swagger_ui() -> Response:
    """Swagger UI for ``/openapi.json`` from ``web/static/vendor/swagger-ui``
    (swagger-ui-dist 5.35.0), so the API docs work offline too."""
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="vlab API",
        swagger_js_url="/static/vendor/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url="/static/vendor/swagger-ui/swagger-ui.css",
        swagger_favicon_url="/static/vendor/swagger-ui/favicon-32x32.png",
    )
