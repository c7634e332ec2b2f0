"""dataflow-plan: explain text or exactly one JSON document; exit 2 with one paragraph and no
traceback for bad input and infeasible budgets."""

import json

import pytest

from dataflow.cli.plan import main
from dataflow.memplan.plan.plan import Plan
from dataflow.memplan.plan.profiles import get_profile, save_profile


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_overview(capsys):
    """A feasible request prints the explanation and exits 0."""
    code, out, err = _run(capsys, "70", "24", "8192", "8b")
    assert code == 0 and err == ""
    for part in ("Chunking:", "Slots:", "Saved activations", "memory (GiB)", "MFU", "HFU",
                 "bottleneck", "Why:"):
        assert part in out


def test_json_prints_exactly_one_plan_document(capsys):
    """--json writes one JSON document that loads back into the same Plan."""
    code, out, err = _run(capsys, "1", "1", "256", "tiny", "--json")
    assert code == 0 and err == ""
    plan = Plan.from_json(out)
    assert json.loads(out)["model"]["name"] == "tiny"
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("argv,needle", [
    (["x", "24", "8192", "8b"], "not a number"),
    (["-1", "24", "8192", "8b"], "positive"),
    (["70", "0", "8192", "8b"], "positive"),
    (["70", "nan", "8192", "8b"], "positive"),
    (["70", "24", "8k", "8b"], "whole number"),
    (["70", "24", "-5", "8b"], "positive"),
    (["70", "24", "8192", "llama8b"], "unknown model 'llama8b'; known: tiny"),
    (["70", "24", "8192", "8b", "--gpu", "v100"], "unknown GPU 'v100'; known: h100"),
    (["70", "24", "8192"], "required"),
    (["1", "1", "65536", "32b"], "does not fit"),
])
def test_bad_input_and_infeasible_budgets_exit_2_with_one_paragraph(capsys, argv, needle):
    """Each bad request exits 2, prints one paragraph naming the problem, no traceback."""
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and "Traceback" not in err
    assert err.strip().count("\n") == 0


def test_infeasible_message_names_smallest_budgets(capsys):
    """The infeasible message names the smallest host and device budgets in GiB."""
    code, _, err = _run(capsys, "1", "1", "65536", "32b")
    assert code == 2 and "smallest budgets that work together are host" in err and "GiB" in err


def test_profile_file_is_used(capsys, tmp_path):
    """--profile FILE plans for the profile in FILE."""
    path = save_profile(get_profile("rtx4090"), tmp_path / "p.json")
    code, out, _ = _run(capsys, "64", "20", "4096", "1b", "--profile", str(path), "--json")
    assert code == 0 and Plan.from_json(out).profile.name == "rtx4090"
    code, _, err = _run(capsys, "64", "20", "4096", "1b", "--profile", str(tmp_path / "no.json"))
    assert code == 2 and "cannot read" in err


def test_gpu_and_profile_are_exclusive(capsys):
    """--gpu and --profile together is a usage error (exit 2)."""
    code, _, err = _run(capsys, "70", "24", "8192", "8b", "--gpu", "h100", "--profile", "x")
    assert code == 2 and "not allowed" in err


def test_help_says_gb_means_gib(capsys):
    """--help explains that GB means GiB (2^30 bytes) and exits 0."""
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "GiB (2^30 bytes)" in out.replace("\n", " ").replace("  ", " ")


def test_debug_shows_the_traceback(capsys):
    """--debug prints a traceback for an error that otherwise gets one line."""
    code, _, err = _run(capsys, "1", "1", "65536", "32b", "--debug")
    assert code == 2 and "Traceback" in err


def test_a_reader_that_stops_early_gets_no_traceback():
    """`dataflow-plan ... --json | head -1`: the plan's 75 KB outgrow the pipe, the reader
    leaves after one line; the command exits 141 (as a shell reports SIGPIPE) with nothing on
    stderr."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "dataflow.cli.plan", "120", "24", "1048576", "1b",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""


def test_refusal_below_both_budgets_names_both(capsys):
    """8b at 8192 on 1/1 GiB: no device budget of 1 GiB works and the host is short too, so the
    way out names both ('try dev_gb 9.8' alone pointed at a budget pair that still fails)."""
    code = main(["1", "1", "8192", "8b"])
    err = capsys.readouterr().err
    assert code == 2
    way = err.split("; try ", 1)[1]
    assert way.startswith("dev_gb ") and " with host_gb " in way.split(";")[0], err


def test_refusal_just_below_the_minimum_suggests_one_consistent_pair():
    """Budgets a byte under the smallest pair: the rounded-up device budget already works with
    this host, so the way out names no host and no second, contradicting device figure."""
    from dataflow.memplan.plan.errors import InfeasibleBudget
    from dataflow.memplan.plan.plan import Budget
    from dataflow.memplan.search.search import make_plan, minimum_budgets
    from dataflow.models.config import load_config

    cfg, prof = load_config("tiny"), get_profile("h100")
    mb = minimum_budgets(cfg, 256, prof)
    with pytest.raises(InfeasibleBudget) as exc:
        make_plan(cfg, 256, Budget(host_bytes=mb.host_bytes - 1,
                                   device_bytes=mb.device_bytes - 1), prof)
    way = str(exc.value).split("; try ", 1)[1]
    assert way.startswith(f"dev_gb {mb.device_gib};"), way
