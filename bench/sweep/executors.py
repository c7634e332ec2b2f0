"""Where cells run: a small executor interface with two implementations. LocalExecutor runs the
cells one after another on this machine (one GPU, one cell at a time); SubmititExecutor sends each
cell to a Slurm cluster through `submitit` (the `sweep-slurm` extra; its 'local' cluster runs the
same path on one machine, which is how it is tested). Either way each cell's worker saves its own
record in the shared sweep directory, so the table stays one and resumable. Never plans cells."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Protocol

from dataflow.bench.sweep.classify import last_line
from dataflow.bench.sweep.record import CellRecord, Status
from dataflow.bench.sweep.runner import CellJob, run_cell


class Executor(Protocol):
    name: str

    def run(self, jobs: Sequence[CellJob]) -> Iterator[CellRecord]:
        """Run every job; yield each cell's record as soon as it is known, in any order."""
        ...


class LocalExecutor:
    name = "local"

    def run(self, jobs: Sequence[CellJob]) -> Iterator[CellRecord]:
        for job in jobs:
            yield run_cell(job)


class SubmititExecutor:
    """One submitit job per cell. `cluster` is submitit's: None (auto: Slurm when present),
    'slurm', 'local' or 'debug'. Slurm time limit: the cell timeout plus 10 minutes of start-up."""

    name = "submitit"

    def __init__(self, folder: str, *, cluster: str | None = None, timeout_s: float,
                 gpus_per_node: int = 0, partition: str | None = None):
        try:
            import submitit
        except ImportError:
            raise ImportError("the submitit executor needs submitit: pip install "
                              "'dataflow[sweep-slurm]' (or use --executor local)") from None
        self._submitit = submitit
        self.executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
        params = {"timeout_min": math.ceil(timeout_s / 60) + 10, "name": "dataflow-sweep"}
        if gpus_per_node:
            params["gpus_per_node"] = gpus_per_node
        if partition:
            params["slurm_partition"] = partition
        self.executor.update_parameters(**params)

    def run(self, jobs: Sequence[CellJob]) -> Iterator[CellRecord]:
        if not jobs:
            return
        submitted = {}
        for job in jobs:
            submitted[self.executor.submit(run_cell, job)] = job
        # submitit rate-limits its own Slurm state queries, so a short poll does not load sacct
        for sub in self._submitit.helpers.as_completed(list(submitted), poll_frequency=1):
            try:
                yield sub.result()
            except Exception as exc:  # noqa: BLE001 - the job died outside the cell's process
                text = str(exc)
                status = Status.TIMEOUT if "TIMEOUT" in text.upper().replace("-", "") \
                    else Status.CRASH
                yield dataclasses.replace(submitted[sub].planned, status=status.value,
                                          error=last_line(text) or type(exc).__name__)
