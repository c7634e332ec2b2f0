"""explain(): a terminal overview of a plan with a reason for every decision."""

from memplan.explain import explain
from memplan.plan import Budget
from memplan.search import make_plan
from models.config import load_config
from models.flops import FLOP_MODEL_VERSION

from .forced import HOME_HOST, forced


def test_explain_covers_every_decision_and_the_prediction(h100):
    """Chunking, rounds, slots, levels, placement, memory vs budget, prediction with the FLOP
    model version, bottleneck, and a 'Why' line per decision."""
    plan = make_plan(load_config("8b"), 65536, Budget.from_gib(144, 78), h100)
    text = explain(plan)
    for part in ("Chunking:", "split into", "round(s) per step", "Slots: weight", "Placement:",
                 "Saved activations", "inp_attn", "memory (GiB)", "budget", "tok/s", "MFU",
                 "HFU", FLOP_MODEL_VERSION, "bottleneck", "Why:", "  - chunk:", "  - layers:",
                 "  - rounds per step:", "  - embedding:", "  - head:", "  - activations:"):
        assert part in text, part


def test_explain_works_for_forced_plans(h100):
    """A forced tiny plan with streamed layers explains its slots and host optimizer."""
    plan = forced(h100, "tiny", 64, layers=(HOME_HOST,) * 2, weight_slots=1, grad_slots=1,
                  embed=HOME_HOST)
    text = explain(plan)
    assert "prefetch depth 0" in text and "on the host" in text and "gathers" in text
