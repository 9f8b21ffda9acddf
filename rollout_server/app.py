"""``build_app(settings)``: the FastAPI app, for uvicorn, the CLI and the tests alike.

One ``ServerCore`` (engine, weight version, sleep state, pause gate, metrics) is shared by the
services of each feature (generation, weights, sleep, status), and each feature's router calls
its service. The engine loads in the background once the server is up, so ``/health`` answers
at once and ``/ready`` turns 200 when generation can start (vLLM can take minutes to load).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from rollout_server.core import ServerCore
from rollout_server.disconnect import CancelOnDisconnectMiddleware
from rollout_server.engine import Engine, load_engine
from rollout_server.error_handlers import install_error_handlers
from rollout_server.generation.router import router as generation_router
from rollout_server.generation.service import GenerationService
from rollout_server.metrics import Metrics
from rollout_server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from rollout_server.native.router import router as native_router
from rollout_server.native.service import NativeService
from rollout_server.openai_compat.router import router as openai_router
from rollout_server.openapi_schema import install_openapi
from rollout_server.settings import ServerSettings
from rollout_server.sleep.router import router as sleep_router
from rollout_server.sleep.service import SleepService
from rollout_server.status.router import router as status_router
from rollout_server.status.service import StatusService
from rollout_server.weights.router import router as weights_router
from rollout_server.weights.service import WeightsService

log = logging.getLogger(__name__)

DOCS_ASSETS = "/docs-assets"  # where the Swagger UI and ReDoc files are served


def build_app(
    settings: ServerSettings,
    engine: Engine | None = None,
    *,
    on_engine_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The app around ``engine`` (default: ``load_engine(settings.engine, settings)``).

    ``on_engine_failure`` is called if the engine fails to load (the CLI stops the server)."""
    engine = engine if engine is not None else load_engine(settings.engine, settings)
    metrics = Metrics()
    core = ServerCore(settings, engine, metrics)
    weights = WeightsService(core)
    native = NativeService(core, weights)
    generation = GenerationService(core)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(core.start(on_engine_failure), name="engine-start")
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            native.close()
            generation.close()
            await weights.close()
            await core.close()

    app = FastAPI(
        title="rollout-server",
        description="Generates completions for a GRPO learner and takes its weight updates.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    mount_offline_docs(app)
    app.state.core = core
    app.state.generation = generation
    app.state.weights = weights
    app.state.native = native
    app.state.sleep = SleepService(core, weights.prepared)
    app.state.status = StatusService(core, native)
    app.state.settings = settings
    install_error_handlers(app)
    for router in (status_router, generation_router, openai_router):
        app.include_router(router)
    if not settings.disable_admin_endpoints:
        app.include_router(weights_router)
        app.include_router(sleep_router)
        app.include_router(native_router)
    install_openapi(app)
    # Added last = outermost: an unauthenticated request is refused before anything else.
    app.add_middleware(CancelOnDisconnectMiddleware)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.limits.max_body_mb * 2**20,
        max_json_bytes=settings.limits.max_json_body_mb * 2**20,
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app


def mount_offline_docs(app: FastAPI) -> None:
    """``/docs`` and ``/redoc`` with their JS and CSS served by the server itself.

    FastAPI's own pages load them from a CDN, so they render blank on a cluster without internet
    access; the files come from the ``fastapi-offline`` package instead."""
    static = importlib.resources.files("fastapi_offline") / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(static)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )
