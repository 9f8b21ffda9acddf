"""Where ``/weights/load_file`` may read: the model's own directory and ``--weights-dir``.

Without a limit the route opened any file the server process could read, and its errors told
a caller which paths exist. Paths are resolved (symlinks, ``..``) before the check, and a path
outside every directory, or one no file can have (a NUL byte, a name too long), is answered
exactly as a missing one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_server.engine.base import WeightsError

if TYPE_CHECKING:
    from rollout_server.settings import ServerSettings


class WeightDirs:
    def __init__(self, dirs: list[str]) -> None:
        self.dirs = dirs

    @classmethod
    def of(cls, settings: ServerSettings) -> WeightDirs:
        """The served model's directory (a hub id has none) and ``settings.weights_dir``."""
        dirs = [settings.model] if os.path.isdir(settings.model) else []
        if settings.weights_dir:
            dirs.append(settings.weights_dir)
        return cls(dirs)

    def check(self, path: str | Path, *, shown: str | Path | None = None) -> Path:
        """``path`` resolved, if it exists inside one of the directories (resolved at each call:
        ``--weights-dir`` may be created after the server starts); else the error a missing
        file gets, naming ``shown`` (default ``path``)."""
        try:
            resolved = Path(os.path.realpath(path))
            inside = any(resolved.is_relative_to(os.path.realpath(d)) for d in self.dirs)
            found = inside and resolved.exists()
        except (ValueError, OSError):  # a NUL byte, a name too long: no such file either
            found = False
        if not found:
            where = ", ".join(self.dirs) or "none: the model is a hub id"
            raise WeightsError(
                f"cannot read {shown or path}: no such file or directory on the server under "
                f"the directories it loads weights from ({where}; --weights-dir adds one)"
            )
        return resolved
