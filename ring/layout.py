"""The one place a ring's layout is chosen (choose_ring_layout): how the job's `gpus` processes
split into replicas of a ring of `ring_size` ranks, with the chunking and placement every rank
plans, as dataflow.memplan.search.layout predicts fastest. dataflow-ring, dataflow-demo --gpus and the
RingEngine all come here. Also what a launching process knows of the ranks' hardware without a
CUDA context. Never spawns processes and never touches a device."""

from __future__ import annotations

import sys

from dataflow.memplan.search.layout import WEIGHED_PLACEMENTS, LayoutChoice, choose_layout, layout_text
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.plan.profiles import get_profile, profile_for_device
from dataflow.memplan.step.ring_rounds import overlap_unsupported
from dataflow.models.errors import ConfigError
from dataflow.ring.job import model_config
from dataflow.ring.kinds import PlacementChoice, TransportKind


def launch_backend(backend: str) -> str:
    """--backend auto as the ranks will resolve it, asked of the driver (no CUDA context in the
    launching process): 'cupy' where NVML shows a GPU, else 'numpy'."""
    if backend != "auto":
        return backend
    try:
        import pynvml  # optional: the NVIDIA driver's bindings

        pynvml.nvmlInit()
        return "cupy" if pynvml.nvmlDeviceGetCount() > 0 else "numpy"
    except Exception:  # noqa: BLE001 - no driver: the NumPy backend
        return "numpy"


def launch_profile(backend: str):
    """The profile the ranks will plan with, found without a CUDA context in this process: the
    CPU's for NumPy, else the one of GPU 0's name as NVML reports it."""
    if backend == "numpy":
        return get_profile("cpu")
    try:
        import pynvml  # optional: the NVIDIA driver's bindings

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return profile_for_device(name.decode() if isinstance(name, bytes) else name)
    except Exception:  # noqa: BLE001 - no driver here: plan as the ranks' default would
        return get_profile("h100")


def process_backend() -> str:
    """--backend auto as this process resolves it (a CUDA context is fine here: it is a rank):
    'cupy' where CuPy sees a GPU, else 'numpy'."""
    try:
        import cupy as cp  # optional: only a GPU rank has it

        return "cupy" if cp.cuda.runtime.getDeviceCount() > 0 else "numpy"
    except Exception:  # noqa: BLE001 - no CuPy or no GPU
        return "numpy"


AUTO_OVERLAP = -1
"""resolve_layout's round_overlap for 'the planner's depth' (dataflow-ring --round-overlap)."""


def choose_ring_layout(cfg, seqlen: int, host_gb: float, dev_gb: float, profile, gpus: int, *,
                       transport: TransportKind, ring_size: int | None = None,
                       constraints: dict | None = None, tokens_per_step: int | None = None,
                       seqs_per_step: int | None = None, split_fetch: bool = False,
                       single_tok_per_s: float | None = ...,
                       round_overlap: bool = False, split_update: bool = False) -> LayoutChoice:
    """The layout of `gpus` processes the planner predicts fastest under per-device budgets of
    host_gb / dev_gb GiB (choose_layout over WEIGHED_PLACEMENTS, unless a 'placement' among
    `constraints` fixes one), planned as the ranks will plan (`profile`, `transport`'s
    reserve; transport NCCL or SHM). ring_size fixes the split; tokens_per_step caps the global
    batch. seqs_per_step (instead of tokens_per_step) keeps a global batch exactly: only splits
    whose replicas divide it are weighed, each replica planning its share. single_tok_per_s: as
    choose_layout's (None skips planning one device for the comparison). round_overlap: weigh
    overlapped rounds as choose_layout does (False: rounds in turn, unless a 'round_overlap'
    depth among `constraints` fixes one). split_update: replicas are weighed with their update
    split too, planned with m / v for their part (choose_layout's; the chosen option's
    constraints then carry 'state_parts' where it was planned so). Raises ConfigError naming
    what does not fit."""
    budget = Budget.from_gib(host_gb, dev_gb)
    if seqs_per_step is None:
        return choose_layout(cfg, seqlen, budget, profile, gpus, tokens_per_step=tokens_per_step,
                             transport=transport.value, ring_size=ring_size,
                             single_tok_per_s=single_tok_per_s, constraints=constraints or None,
                             placements=WEIGHED_PLACEMENTS, split_fetch=split_fetch,
                             round_overlap=round_overlap, split_update=split_update)
    best = None
    sizes = [ring_size] if ring_size is not None else range(1, min(gpus, cfg.n_layers) + 1)
    for size in sizes:
        replicas = gpus // size
        if gpus % size or seqs_per_step % replicas:
            continue
        try:
            share = dict(constraints or {}, seqs_per_step=seqs_per_step // replicas)
            c = choose_layout(cfg, seqlen, budget, profile, gpus, transport=transport.value,
                              ring_size=size, constraints=share,
                              single_tok_per_s=single_tok_per_s, placements=WEIGHED_PLACEMENTS,
                              split_fetch=split_fetch, round_overlap=round_overlap,
                              split_update=split_update)
        except ConfigError:  # this split does not fit (InfeasibleBudget included)
            continue
        if best is None or c.chosen.on(c.link).tok_per_s > best.chosen.on(best.link).tok_per_s:
            best = c
    if best is None:
        raise ConfigError(f"no split of {gpus} processes into replicas of a ring trains "
                          f"{seqs_per_step} sequences a step within {host_gb:g} GiB host and "
                          f"{dev_gb:g} GiB device each for {cfg.name} at seqlen {seqlen}")
    return best


def resolve_layout(model: str, seqlen: int, host_gb: float, dev_gb: float, gpus: int, *,
                   backend: str, transport: TransportKind, replicas: int | None,
                   tokens_per_step: int | None, rounds: int | None, quiet: bool = False,
                   placement: PlacementChoice = "cyclic", split_fetch: bool = False,
                   vocab_parallel: bool = False, round_overlap: int | None = None,
                   split_update: bool = False):
    """(replicas, plan constraints for every rank) of a launch of `gpus` processes, the
    command lines' layout (choose_ring_layout), printed to stderr with the alternatives it
    weighed unless quiet; with replicas given, the chunking of that split that predicts fastest
    (a full ring, at least as many chunks a round as ranks, where one fits). `placement` fixes
    how a ring deals its layers, or 'auto': the faster predicted of WEIGHED_PLACEMENTS; the
    constraints then carry a placement other than cyclic ('placement', RingJob.placement).
    transport: NCCL or SHM. vocab_parallel: rings of 2+ split their head's vocabulary (the
    constraints then carry it). round_overlap: None, rounds in turn; a depth D >= 1, every
    rank planned with room for D local layers of overlapped rounds (the constraints carry it);
    AUTO_OVERLAP, the depth the planner predicts fastest, perhaps none (rounds in turn, said
    on stderr, where its overlapped ranks are ones the ring does not run overlapped yet:
    overlap_unsupported). split_update: replicas split their update (choose_ring_layout's), so a
    layout that fits only with m / v for one part of R is found. Raises ConfigError naming what
    does not fit."""
    if rounds and tokens_per_step:
        raise ConfigError("give --rounds or --tokens-per-step, not both (the global batch is "
                          "rounds x chunks per round x replicas)")
    def choose(overlap: bool) -> LayoutChoice:
        return choose_ring_layout(
            model_config(model), seqlen, host_gb, dev_gb, launch_profile(backend), gpus,
            transport=transport, ring_size=None if replicas is None else gpus // replicas,
            tokens_per_step=tokens_per_step, split_fetch=split_fetch, split_update=split_update,
            constraints={**({"rounds_per_step": rounds} if rounds else {}),
                         **({} if placement == "auto" else {"placement": placement}),
                         **({"vocab_parallel": True} if vocab_parallel else {}),
                         **({"round_overlap": round_overlap} if (round_overlap or 0) > 0
                            else {})},
            round_overlap=overlap)

    choice = choose(round_overlap == AUTO_OVERLAP)
    why = choice.chosen.layout.round_overlap and sorted(
        {w for rp in choice.rank_plans for w in overlap_unsupported(rp)})
    if why:  # the planner's overlapped layout is not one the ring runs yet: rounds in turn
        choice = choose(False)
        if not quiet:
            print(f"round overlap: the planner's overlapped layout has {'; '.join(why)}, which "
                  "overlapped rounds do not run with yet: rounds in turn", file=sys.stderr,
                  flush=True)
    if not quiet:
        print(layout_text(choice), file=sys.stderr, flush=True)
        if (round_overlap or 0) > 0:  # the table predicts the plans as rounds in turn
            print(f"round overlap: {round_overlap} local layer(s) a rank, as asked (the table's "
                  "prediction is of its rounds in turn)", file=sys.stderr, flush=True)
    opt = choice.chosen
    constraints = dict(opt.constraints)
    if round_overlap == AUTO_OVERLAP and opt.layout.round_overlap:
        # the depth the layout was predicted with (planned room, or room its budgets leave):
        # every rank plans with room for it (make_rank_plan's 'round_overlap')
        constraints.setdefault("round_overlap", opt.layout.round_overlap)
    return opt.layout.replicas, tuple(constraints.items())
