"""The fortieth session's plan pairs: bench/records/s39/plans.py's requests (8b at 8k and at 4k,
80/24, 16,384 tokens a step) planned again after the compiled model's link fix (memplan.step.sim
LinkTime, the streamed update's duplex copies, cost.HOST_SUMSQ_BYTES_PER_S): the estimate's pick
and make_plan's, as plan JSON for `dataflow-demo ... --plan`, their compiled predictions in
pairs.json. CPU only.

    python bench/records/s40/plans.py
"""

from __future__ import annotations

import importlib.util
import pathlib

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    spec = importlib.util.spec_from_file_location("s39_plans", HERE.parent / "s39" / "plans.py")
    s39 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s39)
    s39.HERE = HERE / "plans"
    s39.main()


if __name__ == "__main__":
    main()
