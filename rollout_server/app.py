"""``build_app(settings)``: the FastAPI app, for uvicorn, the CLI and the tests alike.

The engine loads in the background once the server is up, so ``/health`` answers at once and
``/ready`` turns 200 when generation can start (vLLM can take minutes to load).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from rollout_server.engine import Engine, load_engine
from rollout_server.errors import install_error_handlers
from rollout_server.metrics import Metrics
from rollout_server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from rollout_server.routes import generate, openai, sleep, status, weights
from rollout_server.service import RolloutService
from rollout_server.settings import ServerSettings

log = logging.getLogger(__name__)


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
    service = RolloutService(settings, engine, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(service.start(on_engine_failure), name="engine-start")
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await service.close()

    app = FastAPI(
        title="rollout-server",
        description="Generates completions for a GRPO learner and takes its weight updates.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.settings = settings
    install_error_handlers(app)
    for router in (status.router, generate.router, openai.router):
        app.include_router(router)
    if not settings.disable_admin_endpoints:
        app.include_router(weights.router)
        app.include_router(sleep.router)
    # Added last = outermost: an unauthenticated request is refused before anything else.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_mb * 2**20)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app
