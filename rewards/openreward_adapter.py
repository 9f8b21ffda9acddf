"""Use an environment served over the Open Reward Standard (the ``openreward`` SDK) as ours.

``openreward_environment(target)`` returns an ``Environment`` subclass whose catalogue calls
(``list_splits``, ``list_tasks``) and episodes (one ORS session each: prompt, tools, tool calls,
terminal tool) go to the server. ``target`` is either

- a URL of a server started with the SDK's ``Server`` (``http://127.0.0.1:8080``), optionally with
  the environment's name as path (``http://127.0.0.1:8080/wordle``) when it serves several; or
- the name of a hosted environment (``owner/env``, optionally ``owner/env/variant``); the API key
  comes from ``OPENREWARD_API_KEY``.

The registry maps ``load_environment("openreward:<target>")`` here, so training on one is a
single config line. The SDK is an optional extra (``pip install 'grpo-service[openreward]'``)
imported only when an adapter is used.

What the model gets wrong (unknown tool, invalid arguments, a call after the episode finished)
comes back as an error message it can read; a tool that raised on the server ends the episode
with an error, as the SDK marks that session dead. What the user gets wrong (a bad target, a
server that is not running, an environment name it does not serve) is an
``OpenRewardAdapterError`` from the catalogue calls, a ``PluginError`` like the registry's, so
the learner reports it in one line before any model loads.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar
from urllib.parse import urlparse

import httpx

from rewards.env import Environment, ToolResult, ToolSpec
from rewards.errors import PluginError

_MODEL_ERRORS = {"not_found", "name_collision", "input_validation", "bad_input_shape"}


class OpenRewardAdapterError(PluginError, RuntimeError):
    """The remote environment cannot be used as asked (bad target, a server that cannot be
    reached or does not serve it, unsupported content)."""


def _sdk() -> Any:
    try:
        import openreward
    except ImportError as e:
        raise OpenRewardAdapterError(
            "the openreward SDK is not installed; pip install 'grpo-service[openreward]'"
        ) from e
    return openreward


def parse_target(target: str) -> tuple[str, str | None, str | None]:
    """``(name, variant, base_url)`` of a target; ``base_url`` None for the hosted platform."""
    target = target.strip()
    if target.startswith(("http://", "https://")):
        url = urlparse(target)
        if not url.netloc:
            raise OpenRewardAdapterError(f"openreward target {target!r} has no host")
        path = url.path.strip("/")
        if "/" in path:
            raise OpenRewardAdapterError(
                f"openreward target {target!r}: the URL path must be one environment name"
            )
        return (path or url.netloc), (path or None), f"{url.scheme}://{url.netloc}"
    parts = [p for p in target.split("/") if p]
    if len(parts) not in (2, 3):
        raise OpenRewardAdapterError(
            f"openreward target {target!r}: use a server URL (http://host:port[/env]) or a "
            f"hosted name (owner/env[/variant])"
        )
    return "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None), None


def _text(blocks: Any, what: str) -> str:
    texts = []
    for block in blocks:
        if getattr(block, "type", "text") != "text":
            raise OpenRewardAdapterError(
                f"{what} contains a {block.type!r} block; only text is supported"
            )
        texts.append(block.text)
    return "\n".join(texts)


class OpenRewardEnvironment(Environment):
    """Base of adapter classes; ``openreward_environment`` sets the class attributes."""

    ors_target: ClassVar[str]
    ors_name: ClassVar[str]
    ors_variant: ClassVar[str | None] = None
    ors_base_url: ClassVar[str | None] = None
    ors_api_key: ClassVar[str | None] = None

    def __init__(self, task: dict[str, Any]) -> None:
        super().__init__(task)
        self._api: Any = None
        self._session: Any = None

    @classmethod
    def _open(cls) -> tuple[Any, Any]:
        """A fresh SDK client (owns an aiohttp session: close it with ``aclose``) and env."""
        sdk = _sdk()
        key = cls.ors_api_key if cls.ors_api_key is not None else os.getenv("OPENREWARD_API_KEY")
        if cls.ors_base_url is None and not key:
            raise OpenRewardAdapterError(
                f"the hosted environment {cls.ors_name!r} needs an API key: set "
                f"OPENREWARD_API_KEY (or pass api_key= to openreward_environment)"
            )
        api = sdk.AsyncOpenReward(api_key=key or "").environments
        return api, api.get(cls.ors_name, variant=cls.ors_variant, base_url=cls.ors_base_url)

    @classmethod
    async def _catalogue(cls, what: str, call: Any) -> Any:
        """``await call(env)`` on a fresh client; its failures become one-line errors."""
        if cls.ors_base_url is not None:  # fail at once, not after the SDK's retries
            try:
                async with httpx.AsyncClient(timeout=10) as http:
                    await http.get(f"{cls.ors_base_url}/health")
            except httpx.TransportError as e:
                raise OpenRewardAdapterError(
                    f"openreward:{cls.ors_target}: cannot reach the server at "
                    f"{cls.ors_base_url} ({type(e).__name__}: {e}); start it, or fix the URL"
                ) from None
        api, env = cls._open()
        try:
            return await call(env)
        except Exception as e:
            raise await cls._catalogue_error(what, e) from e
        finally:
            await api.aclose()

    @classmethod
    async def _catalogue_error(cls, what: str, e: Exception) -> OpenRewardAdapterError:
        where = f"openreward:{cls.ors_target}"
        if getattr(e, "status", None) == 404 and cls.ors_base_url is not None:
            try:
                async with httpx.AsyncClient(timeout=10) as http:
                    served = (await http.get(f"{cls.ors_base_url}/list_environments")).json()
            except (httpx.HTTPError, ValueError):
                served = "?"
            return OpenRewardAdapterError(
                f"{where}: the server at {cls.ors_base_url} does not serve an environment "
                f"{cls.ors_variant!r} (it serves {served}); use "
                f"openreward:{cls.ors_base_url}/<one of those>, or no path for its default"
            )
        detail = str(e).splitlines()[0] if str(e) else ""
        return OpenRewardAdapterError(f"{where}: {what} failed: {type(e).__name__}: {detail}")

    @classmethod
    async def list_splits(cls) -> list[str]:  # type: ignore[override]
        return list(await cls._catalogue("listing the splits", lambda env: env.list_splits()))

    @classmethod
    async def list_tasks(cls, split: str) -> list[dict[str, Any]]:  # type: ignore[override]
        tasks = await cls._catalogue(
            f"listing the tasks of split {split!r}", lambda env: env.list_tasks(split)
        )
        return [dict(t.task_spec) for t in tasks]

    async def setup(self) -> None:
        from openreward.api.environments.types import Task

        self._api, env = self._open()
        namespace, _, name = self.ors_name.rpartition("/")
        task = Task(
            server_name=name,
            environment_name=self.ors_variant,  # None: the server's default environment
            task_spec=self.task,
            namespace=namespace or None,
        )
        session = env.session(task=task)
        await session.__aenter__()
        self._session = session

    async def teardown(self) -> None:
        try:
            if self._session is not None:
                await self._session.__aexit__(None, None, None)
        finally:
            self._session = None
            if self._api is not None:
                await self._api.aclose()
                self._api = None

    async def get_prompt(self) -> str:  # type: ignore[override]
        return _text(await self._session.get_prompt(), "the prompt")

    async def get_tools(self) -> list[ToolSpec]:
        specs = [
            ToolSpec(
                name=t.name,
                description=t.description or "",
                parameters=dict(t.input_schema or {"type": "object", "properties": {}}),
            )
            for t in await self._session.list_tools()
        ]
        term = await self._session.terminal_tool()
        if term is not None:
            specs.append(
                ToolSpec(
                    name=term.name,
                    description=term.description,
                    terminal=True,
                    terminal_arg=term.arg,
                )
            )
        return specs

    async def _result(self, call: Any) -> ToolResult:
        from openreward.api.errors import ToolCallError

        try:
            out = await call
        except ToolCallError as e:
            if e.reason in _MODEL_ERRORS or e.reason == "episode_finished":
                return ToolResult(text=f"Error: {e.detail}", is_error=True)
            raise
        result = ToolResult(
            text=_text(out.blocks, "a tool result"), reward=out.reward, finished=out.finished
        )
        self.finished = self.finished or result.finished
        return result

    async def call_tool(self, name: str, args: dict[str, Any]) -> ToolResult:
        return await self._result(self._session.call_tool(name, args))

    async def call_terminal(self, message: str) -> ToolResult:
        return await self._result(self._session.call_terminal_tool(message))


def openreward_environment(target: str, *, api_key: str | None = None) -> type[Environment]:
    """An ``Environment`` class for the ORS environment at ``target`` (see the module doc)."""
    name, variant, base_url = parse_target(target)
    attrs = {
        "ors_target": target,
        "ors_name": name,
        "ors_variant": variant,
        "ors_base_url": base_url,
        "ors_api_key": api_key,
        "__doc__": f"The Open Reward Standard environment {target!r}.",
    }
    return type(f"OpenReward[{target}]", (OpenRewardEnvironment,), attrs)
