"""Multi-turn environments, shaped like the Open Reward Standard (ORS).

An environment class lists its splits and tasks; the episode runner builds one instance per
episode from a task spec (a JSON-able dict), calls ``setup()``, shows the model ``get_prompt()``
and the tools, and routes the model's tool calls to ``call_tool``. Tools are methods marked with
``@tool`` that take one pydantic model (the arguments; its JSON schema is what the model sees) and
return a ``ToolResult``: the text shown to the model, an optional reward, and whether the episode
is over. One tool may be marked ``@tool(terminal=True)``: it is hidden from the model, and a plain
final assistant message (no tool call) is passed to it as its single argument, which is how
question-answer environments grade an answer.

Sync methods run in a worker thread so a slow tool never blocks the event loop that drives the
other episodes of the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError

from grpo_common.threads import call_maybe_async
from rewards.errors import PluginError

Prompt = str | list[dict[str, Any]]
"""A user message, or a full list of chat messages (``{"role": ..., "content": ...}``)."""


class ToolResult(BaseModel):
    """What a tool call returns. ``reward`` None means the call does not grade anything;
    ``is_error`` marks a call that was refused (unknown tool, invalid arguments, episode over),
    which the model sees as text like any other result."""

    model_config = ConfigDict(extra="forbid")

    text: str
    reward: float | None = None
    finished: bool = False
    is_error: bool = False


class ToolSpec(BaseModel):
    """A tool as the model sees it. ``parameters`` is the JSON schema of the argument model."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    terminal: bool = False
    terminal_arg: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The ``tools=[...]`` entry of chat templates and the OpenAI API."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class EnvironmentDefinitionError(Exception):
    """An environment is declared wrongly (bad tool signature, two terminal tools, ...)."""


def tool(fn: Callable | None = None, *, terminal: bool = False) -> Any:
    """Declare a method as a tool: ``@tool`` or ``@tool(terminal=True)``.

    The method takes ``self`` and at most one argument annotated with a pydantic model, and
    returns a ``ToolResult`` (sync or async). Its docstring is the description the model sees.
    """

    def mark(f: Callable) -> Callable:
        f._rewards_tool = {"terminal": terminal}  # type: ignore[attr-defined]
        return f

    return mark if fn is None else mark(fn)


def _arg_model(cls: type, name: str, fn: Callable) -> type[BaseModel] | None:
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    if not params:
        return None
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # NameError: an annotation names what the module does not define
        raise EnvironmentDefinitionError(
            f"tool {cls.__name__}.{name}: its annotations cannot be resolved ({type(e).__name__}: "
            f"{e}); define or import the argument model at module level"
        ) from e
    hint = hints.get(params[0].name) if len(params) == 1 else None
    if not (inspect.isclass(hint) and issubclass(hint, BaseModel)):
        takes = ", ".join(
            f"{p.name}: {getattr(hints[p.name], '__name__', hints[p.name])}"
            if p.name in hints
            else p.name
            for p in params
        )
        raise EnvironmentDefinitionError(
            f"tool {cls.__name__}.{name} takes ({takes}); a tool takes exactly one argument "
            f"annotated with a pydantic model (or none), e.g. `def {name}(self, args: "
            f"{name.title().replace('_', '')}Args) -> ToolResult` with `class "
            f"{name.title().replace('_', '')}Args(BaseModel)` holding the fields."
        )
    return hint


class Environment:
    """Base class of environments. Subclasses implement ``list_splits``, ``list_tasks`` and
    ``get_prompt``, declare tools with ``@tool``, and may override ``setup``/``teardown``."""

    _tool_cache: ClassVar[dict[type, tuple[list[ToolSpec], dict[str, type[BaseModel] | None]]]] = {}

    def __init__(self, task: dict[str, Any]) -> None:
        self.task = task
        self.finished = False

    # ---- the task catalogue (class level; sync or async) ----
    @classmethod
    def list_splits(cls) -> list[str] | Awaitable[list[str]]:
        raise NotImplementedError(f"{cls.__name__} must implement the classmethod list_splits()")

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]] | Awaitable[list[dict[str, Any]]]:
        raise NotImplementedError(f"{cls.__name__} must implement the classmethod list_tasks()")

    # ---- one episode ----
    async def setup(self) -> None:
        """Acquire what the episode needs (a sandbox, a session). Called once before the prompt."""

    async def teardown(self) -> None:
        """Release it. Always called, also when setup or the episode failed."""

    def get_prompt(self) -> Prompt | Awaitable[Prompt]:
        raise NotImplementedError(f"{type(self).__name__} must implement get_prompt()")

    @classmethod
    def check_definition(cls) -> None:
        """Raise ``EnvironmentDefinitionError`` for what would fail in every episode: a method
        that must be implemented and is not, a tool declared wrongly."""
        missing = [
            name
            for name in ("list_splits", "list_tasks", "get_prompt")
            if getattr(cls, name).__qualname__.startswith("Environment.")
        ]
        if missing:
            raise EnvironmentDefinitionError(
                f"{cls.__name__} does not implement {', '.join(f'{m}()' for m in missing)}; "
                f"see the example in docs/rewards.md"
            )
        cls.list_tools()

    @classmethod
    def list_tools(cls) -> list[ToolSpec]:
        """The tools declared with ``@tool`` on this class, terminal tool included (flagged)."""
        return cls._tools()[0]

    async def get_tools(self) -> list[ToolSpec]:
        """The tools of this episode. Defaults to the class's; environments whose tools depend on
        the task or on a remote session override it."""
        return self.list_tools()

    @classmethod
    def _tools(cls) -> tuple[list[ToolSpec], dict[str, type[BaseModel] | None]]:
        if cls not in Environment._tool_cache:
            specs, models = [], {}
            for name in sorted(dir(cls)):
                fn = getattr(cls, name, None)
                meta = getattr(fn, "_rewards_tool", None)
                if meta is None:
                    continue
                model = _arg_model(cls, name, fn)
                models[name] = model
                terminal_arg = None
                if meta["terminal"] and model is not None:
                    fields = list(model.model_fields)
                    if len(fields) != 1:
                        raise EnvironmentDefinitionError(
                            f"terminal tool {cls.__name__}.{name} receives the final message as "
                            f"its only argument, but {model.__name__} has fields {fields}; give "
                            f"it exactly one field (or no argument at all)."
                        )
                    terminal_arg = fields[0]
                schema = (
                    model.model_json_schema() if model else {"type": "object", "properties": {}}
                )
                specs.append(
                    ToolSpec(
                        name=name,
                        description=inspect.getdoc(fn) or "",
                        parameters=schema,
                        terminal=meta["terminal"],
                        terminal_arg=terminal_arg,
                    )
                )
            terminals = [s.name for s in specs if s.terminal]
            if len(terminals) > 1:
                raise EnvironmentDefinitionError(
                    f"{cls.__name__} declares several terminal tools {terminals}; keep one."
                )
            Environment._tool_cache[cls] = (specs, models)
        return Environment._tool_cache[cls]

    async def call_tool(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Run a tool. The model's mistakes (unknown tool, invalid arguments, a call after the
        episode finished) come back as ``is_error`` results; a tool that raises propagates."""
        if self.finished:
            return ToolResult(
                text=f"Error: {name!r} was not run: the episode has finished.", is_error=True
            )
        specs, models = self._tools()
        if name not in models or any(s.name == name and s.terminal for s in specs):
            visible = [s.name for s in specs if not s.terminal]
            return ToolResult(
                text=f"Error: unknown tool {name!r}; available tools: {visible}.", is_error=True
            )
        model = models[name]
        call_args: tuple[Any, ...] = ()
        if model is not None:
            try:
                call_args = (model.model_validate(args),)
            except ValidationError as e:
                return ToolResult(text=f"Error: invalid arguments for {name!r}: {e}", is_error=True)
        return await self._run(name, call_args)

    async def call_terminal(self, message: str) -> ToolResult:
        """Pass a plain final assistant message to the terminal tool."""
        spec = next((s for s in self.list_tools() if s.terminal), None)
        if spec is None:
            raise EnvironmentDefinitionError(f"{type(self).__name__} has no terminal tool")
        if self.finished:
            return ToolResult(text="Error: the episode has finished.", is_error=True)
        model = self._tools()[1][spec.name]
        call_args = () if model is None else (model.model_validate({spec.terminal_arg: message}),)
        return await self._run(spec.name, call_args)

    async def _run(self, name: str, call_args: tuple[Any, ...]) -> ToolResult:
        result = await call_maybe_async(getattr(self, name), *call_args)
        if not isinstance(result, ToolResult):
            raise TypeError(
                f"tool {type(self).__name__}.{name} returned {type(result).__name__}; "
                f"return a rewards.env.ToolResult"
            )
        if result.finished:
            self.finished = True
        return result


async def get_splits(env_cls: type[Environment]) -> list[str]:
    """``env_cls.list_splits()``, awaited if async."""
    return list(await call_maybe_async(env_cls.list_splits))


class UnknownSplitError(PluginError, ValueError):
    """A split the environment does not list, or one that lists no tasks."""


async def get_tasks(env_cls: type[Environment], split: str) -> list[dict[str, Any]]:
    """``env_cls.list_tasks(split)``, awaited if async, for a split that ``list_splits`` names
    (not whatever ``list_tasks`` makes of another: an exception, or some other split's tasks)
    and that has tasks; else ``UnknownSplitError``."""
    splits = await get_splits(env_cls)
    if split not in splits:
        raise UnknownSplitError(
            f"{split!r} is not a split of {env_cls.__name__}; its splits are "
            f"{', '.join(map(repr, splits)) or '(none)'}: set environment.split to one of them"
        )
    tasks = list(await call_maybe_async(env_cls.list_tasks, split))
    if not tasks:
        raise UnknownSplitError(f"{env_cls.__name__} lists no tasks in split {split!r}")
    return tasks
