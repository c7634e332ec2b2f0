"""The planner: decides where every byte of training state lives (device or pinned host memory),
what is prefetched and recomputed, and predicts the step. Pure Python: never imports array
libraries, never touches a device. See docs/planner.md."""

from memplan.build import build_plan
from memplan.cost import predict, predict_schedule
from memplan.decisions import ALLOWED_PLACEMENTS, Decisions, validate_decisions
from memplan.errors import InfeasibleBudget
from memplan.explain import explain
from memplan.memory import device_regions, host_regions, memory_map
from memplan.plan import (
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
from memplan.profiles import get_profile, known_profiles, load_profile, save_profile
from memplan.search import MinimumBudgets, make_plan, minimum_budgets

__all__ = [
    "build_plan", "make_plan", "minimum_budgets", "MinimumBudgets", "explain", "predict", "predict_schedule",
    "device_regions", "host_regions", "memory_map", "Decisions", "validate_decisions",
    "ALLOWED_PLACEMENTS", "InfeasibleBudget", "get_profile", "known_profiles", "load_profile",
    "save_profile", "Budget", "Chunking", "GradAccum", "HardwareProfile", "LayerPlacement",
    "MemoryMap", "OptimizerWhere", "Plan", "Prediction", "SavedActivation", "Slots", "Where",
]
