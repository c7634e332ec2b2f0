"""The engine's precision setting (issue 53): 'bf16', today's arithmetic and the default, or
'fp8', the block projections' GEMMs in the FP8 recipe of dataflow.kernels.reference.fp8. Only
the names and their check live here; the backends say which they run
(dataflow.backend.Backend.set_precision). Never touches a backend or a plan."""

from __future__ import annotations

from dataflow.models.errors import ConfigError

PRECISIONS = ("bf16", "fp8")


def check_precision(value) -> str:
    """`value` if it names a precision, else a ConfigError naming it and the choices."""
    if value not in PRECISIONS:
        raise ConfigError(f"precision {value!r}; choose one of {', '.join(PRECISIONS)} "
                          "(fp8: the linear layers' GEMMs in FP8, docs/fp8.md)")
    return value
