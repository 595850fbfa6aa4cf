"""Run portspeed from its source tree without installing it (benchmarks/gpu_check.sh puts this folder on PYTHONPATH).

Why: an install maps ``portspeed.adapters`` and ``portspeed.patches`` onto the top-level ``adapters/`` and
``patches/`` folders (pyproject.toml's package-dir); with only ``PYTHONPATH=<repo>`` those two names would not
import. This finder, last on ``sys.meta_path`` (an installed portspeed is found first and wins), maps them;
every process started with this PYTHONPATH (torchrun's workers, the conformance ranks) gets it. Entry points
(the ``portspeed`` command, the test device, the stand-in) stay absent: nothing gpu_check.sh runs needs them.
Another ``sitecustomize`` later on ``sys.path`` (an image's own) still runs after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAPPED = {"portspeed.adapters": "adapters", "portspeed.patches": "patches"}


class _TreeFinder(importlib.abc.MetaPathFinder):
    """portspeed.adapters / portspeed.patches -> <repo>/adapters, <repo>/patches (their submodules follow __path__)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        folder = _MAPPED.get(fullname)
        if folder is None:
            return None
        init = os.path.join(_REPO, folder, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init,
                                                      submodule_search_locations=[os.path.join(_REPO, folder)])


sys.meta_path.append(_TreeFinder())


def _chain() -> None:
    """Run the next sitecustomize on sys.path, the one this module shadows, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


_chain()
