"""dataflow: train large transformers on one GPU (or a ring of them) by streaming state between
pinned host memory and the device.

The installed import names are all under `dataflow`: `dataflow.memplan` (the planner),
`dataflow.models`, `dataflow.kernels`, `dataflow.ring` and `dataflow.bench`. The most used names
are importable from here, loaded on first use so that `import dataflow.memplan` stays free of
array libraries. This module must never import anything eagerly.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# In a source checkout the planner, models, kernels, ring and bench are sibling folders of this
# one (the repository keeps the design card's layout); an installed wheel puts them inside this
# package. Adding the checkout's root to __path__ makes `dataflow.memplan` resolve in both.
_ROOT = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "memplan").is_dir() and (_ROOT / "memplan" / "__init__.py").is_file():
    __path__.append(str(_ROOT))  # noqa: F821 (a package's __path__)

try:
    from importlib.metadata import PackageNotFoundError, version as _version
    __version__ = _version("dataflow")
except PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "Engine": "dataflow.engine",
    "StepResult": "dataflow.engine",
    "ConfigError": "dataflow.models.errors",
    "NonFiniteError": "dataflow.models.errors",
    "ChecksumError": "dataflow.models.errors",
    "StepFailedError": "dataflow.models.errors",
    "UnknownOptionError": "dataflow.engine_options",
    "ModelConfig": "dataflow.models.config",
    "InfeasibleBudget": "dataflow.memplan.plan.errors",
    "Ring": "dataflow.ring.engine",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dataflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
