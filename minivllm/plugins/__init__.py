"""Plugins: code a separate package runs in every minivllm process, with no fork and no
monkey patching (vLLM's `vllm.plugins.load_general_plugins`, entry-point group
`vllm.general_plugins`).

A package declares, in its pyproject.toml:

    [project.entry-points."minivllm.general_plugins"]
    my_plugin = "my_package.plugin:register"

and `register()` runs once per process, before the engine (or a worker process) builds
anything: it typically calls `ModelRegistry.register_model`, `register_connector`,
`register_backend` or `PolicyFactory.register`. `MINIVLLM_PLUGINS=a,b` loads only the plugins
named (vLLM's `VLLM_PLUGINS`); unset, all of them.

Why not monkey patching (what KV-cache systems did to vLLM before the connector interface):
a patch replaces a private function by its name, so it breaks silently when that function is
renamed, must be applied in every process by hand, and two patches of one function overwrite
each other. An interface names what may change, and the entry point makes every process load
the plugin.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

logger = logging.getLogger(__name__)

PLUGINS_GROUP = "minivllm.general_plugins"
PLUGINS_ENV = "MINIVLLM_PLUGINS"
_loaded = False


def load_general_plugins() -> list[str]:
    """Run every plugin's function once in this process; returns the names run this call.

    A plugin that raises is logged and skipped (vLLM's rule): a broken extension must not stop
    an engine that may not even need it.
    """
    global _loaded
    if _loaded:
        return []
    _loaded = True
    allowed = os.environ.get(PLUGINS_ENV)
    names = None if allowed is None else {name.strip() for name in allowed.split(",") if name.strip()}
    loaded = []
    for entry_point in importlib.metadata.entry_points(group=PLUGINS_GROUP):
        if names is not None and entry_point.name not in names:
            continue
        try:
            entry_point.load()()
        except Exception:
            logger.exception("plugin %s (%s) failed; going on without it", entry_point.name, entry_point.value)
            continue
        logger.info("loaded plugin %s", entry_point.name)
        loaded.append(entry_point.name)
    return loaded
