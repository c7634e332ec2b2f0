"""The planner: decides where every byte of training state lives (device or pinned host memory),
what is prefetched and recomputed, and predicts the step. Pure Python: never imports array
libraries, never touches a device. See docs/planner.md."""

from dataflow.memplan.plan.decisions import ALLOWED_PLACEMENTS, Decisions, validate_decisions
from dataflow.memplan.plan.errors import InfeasibleBudget
from dataflow.memplan.plan.memory import device_regions, host_regions, memory_map
from dataflow.memplan.plan.plan import (
                          Budget,
                          Chunking,
                          GradAccum,
                          HardwareProfile,
                          LayerPlacement,
                          MemoryMap,
                          OptimizerWhere,
                          Plan,
                          Prediction,
                          SavedActivation,
                          Slots,
                          Where,
)
from dataflow.memplan.plan.profiles import get_profile, known_profiles, load_profile, save_profile
from dataflow.memplan.search.build import build_plan
from dataflow.memplan.search.cost import predict
from dataflow.memplan.search.explain import explain
from dataflow.memplan.search.predict import predict_schedule
from dataflow.memplan.search.search import MinimumBudgets, make_plan, minimum_budgets

__all__ = [
    "build_plan", "make_plan", "minimum_budgets", "MinimumBudgets", "explain", "predict", "predict_schedule",
    "device_regions", "host_regions", "memory_map", "Decisions", "validate_decisions",
    "ALLOWED_PLACEMENTS", "InfeasibleBudget", "get_profile", "known_profiles", "load_profile",
    "save_profile", "Budget", "Chunking", "GradAccum", "HardwareProfile", "LayerPlacement",
    "MemoryMap", "OptimizerWhere", "Plan", "Prediction", "SavedActivation", "Slots", "Where",
]
