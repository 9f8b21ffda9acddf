"""The base class of the errors a user fixes in their config or their plugin, not in the code.

``PluginError`` has a module of its own because the registry, the environment base class and the
Open Reward adapter each raise subclasses of it while none of them may import the others' module
for it (the registry loads environments and adapters, so it sits above both). The learner catches
it to report such an error in one line, before any model loads.
"""

from __future__ import annotations


class PluginError(Exception):
    """A reward or environment cannot be found, loaded or used as configured."""
