"""explain(): a terminal overview of a plan with a reason for every decision."""

from dataflow.memplan.search.explain import explain
from dataflow.memplan.plan.plan import Budget
from dataflow.memplan.search.search import make_plan
from dataflow.models.config import load_config
from dataflow.models.flops import FLOP_MODEL_VERSION

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


def test_why_names_the_bottleneck_and_shares_of_the_simulated_prediction():
    """The reasons' bottleneck line quotes the same simulated step the Prediction line prints
    (the search's per-round estimate once named another bottleneck at 8b@64k)."""
    from dataflow.memplan import explain, make_plan
    from dataflow.memplan.search.predict import predict_schedule
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.plan.profiles import get_profile
    from dataflow.models.config import load_config

    plan = make_plan(load_config("8b"), 65536, Budget.from_gib(96, 30), get_profile("h100"))
    pr = predict_schedule(plan, plan.profile)
    text = explain(plan)
    why = text.split("Why:")[1]
    assert f"bottleneck: {pr.bottleneck} (" in why
    assert f"of {pr.step_time_s:.2f} s)" in why and f"bottleneck: {pr.bottleneck}" in \
        text.split("Why:")[0]


def test_explain_predicts_the_update_mode_the_run_uses(h100):
    """dataflow-demo --eager-update / --backward-update print the prediction of their own
    schedule (an earlier note: the demo printed the deferred update's for every mode)."""
    import pytest

    from dataflow.memplan.search.predict import predict_schedule

    plan = make_plan(load_config("8b"), 8192, Budget.from_gib(80, 24), h100)
    for update, flag in (("end", "--eager-update"), ("backward", "--backward-update")):
        text = explain(plan, update=update)
        step = predict_schedule(plan, plan.profile, update=update).step_time_s
        head = text.split("Why:")[0]
        assert flag in head and f"step {step:.2f} s" in head, update
        assert flag in text.split("Why:")[1]
    default = explain(plan)
    assert "--eager-update" not in default and "inside the next step's first round" in default
    assert f"step {predict_schedule(plan, plan.profile).step_time_s:.2f} s" in default
    with pytest.raises(ValueError, match="update='later'"):
        explain(plan, update="later")


def test_an_moe_plan_says_how_far_its_prediction_is_measured(h100):
    """The prediction of an MoE model charges the experts at a small-GEMM rate measured on one
    shape and GPU (docs/moe.md): the explanation says so, and a dense plan does not."""
    moe = make_plan(load_config("olmoe-1b-7b"), 8192, Budget.from_gib(120, 24), h100)
    dense = make_plan(load_config("1b"), 8192, Budget.from_gib(40, 16), h100)
    assert ("MoE: the routed experts are charged at a small-GEMM rate fitted to two models"
            in explain(moe))
    assert "MoE:" not in explain(dense)
