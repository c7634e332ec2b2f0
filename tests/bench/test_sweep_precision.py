"""dataflow-sweep --precision as a grid axis: a comma list (bf16,fp8) plans and runs every cell in
every precision (a real two-cell x two-precision sweep of `tiny` on the NumPy backend, whose fp8
runs the recipe's NumPy transcription), one table row per cell and precision, resumed per (cell,
precision); a one-precision sweep keeps its directory as before; a directory refuses a resume
with other precisions, naming the --precision to pass; LoRA refuses an FP8 base in a list too."""

import json
import logging

import pytest

from dataflow.bench.sweep.grid import Cell, expand, parse_precisions
from dataflow.bench.sweep.plot import plot_sweep
from dataflow.bench.sweep.sweep import SweepConfig, _refuse_other_precisions
from dataflow.bench.sweep.table import SweepStore, read_table
from dataflow.cli.sweep import main
from dataflow.models.errors import ConfigError

TINY = ["run", "--model", "tiny", "--seqlen", "128", "--host", "1", "--dev", "0.25,0.5",
        "--steps", "1", "--backend", "numpy"]
PREDICT = ["run", "--model", "8b", "--seqlen", "8192", "--host", "64,80", "--dev", "24",
           "--predict-only", "--gpu", "h200"]


def test_precision_list_parses_in_order_and_bad_names_are_refused_with_the_choices():
    """'bf16,fp8' is two precisions in the order given (repeats dropped); an unknown name is
    refused naming it and the spellings that work."""
    assert parse_precisions("bf16") == ("bf16",)
    assert parse_precisions("fp8, bf16,fp8") == ("fp8", "bf16")
    with pytest.raises(ConfigError, match=r"'fp16' is not a precision; choose from bf16, fp8"):
        parse_precisions("bf16,fp16")
    with pytest.raises(ConfigError, match="no precision"):
        parse_precisions(" , ")


def test_grid_expands_each_budget_pair_in_every_precision_back_to_back():
    """Precision is the innermost axis: a cell's bf16 and fp8 twins are neighbours, keyed (and
    hashed) apart, and one precision gives the cells of before (bf16 by default)."""
    cells = expand(("tiny",), (128,), (1.0,), (0.25, 0.5), ("bf16", "fp8"))
    assert [(c.dev_gib, c.precision) for c in cells] == [
        (0.25, "bf16"), (0.25, "fp8"), (0.5, "bf16"), (0.5, "fp8")]
    assert len(set(cells)) == 4 and len({c.sort_key for c in cells}) == 4
    assert cells[0].key == cells[1].key == ("tiny", 128, 1.0, 0.25)  # the grid point
    assert cells[0].slug == cells[1].slug  # the store, not the cell, names a grid's files
    assert expand(("tiny",), (128,), (1.0,), (0.25,)) == (
        Cell(model="tiny", seqlen=128, host_gib=1.0, dev_gib=0.25),)


def test_a_precision_grid_predicts_every_cell_in_both_and_names_records_by_precision(tmp_path):
    """--precision bf16,fp8 gives one row per cell and precision, each planned in its own (the
    H200's measured FP8 rate predicts more for fp8), with record names ending in the precision;
    a one-precision fp8 sweep keeps the names of before."""
    assert main([*PREDICT, "--precision", "bf16,fp8", "--out", str(tmp_path / "g")]) == 0
    rows = read_table(tmp_path / "g")
    assert [(r.host_gib, r.precision) for r in rows] == [
        (64.0, "bf16"), (64.0, "fp8"), (80.0, "bf16"), (80.0, "fp8")]
    for bf16, fp8 in (rows[:2], rows[2:]):
        assert fp8.predicted_tok_per_s > bf16.predicted_tok_per_s
        assert fp8.plan_hash != bf16.plan_hash
    names = sorted(p.name for p in (tmp_path / "g" / "cells").iterdir())
    assert names == ["8b-s8192-h64-d24-bf16.json", "8b-s8192-h64-d24-fp8.json",
                     "8b-s8192-h80-d24-bf16.json", "8b-s8192-h80-d24-fp8.json"]
    assert main([*PREDICT, "--precision", "fp8", "--out", str(tmp_path / "f")]) == 0
    assert sorted(p.name for p in (tmp_path / "f" / "cells").iterdir()) == [
        "8b-s8192-h64-d24.json", "8b-s8192-h80-d24.json"]
    assert [r.precision for r in read_table(tmp_path / "f")] == ["fp8", "fp8"]


def test_two_cell_two_precision_tiny_sweep_runs_resumes_per_cell_and_precision(tmp_path, caplog):
    """Four real cells (two budgets x bf16, fp8) train and are recorded, each on a plan in its
    precision; a rerun skips all four; with one record gone only that (cell, precision) runs."""
    caplog.set_level(logging.INFO, logger="dataflow.sweep")
    out = tmp_path / "s"
    assert main([*TINY, "--precision", "bf16,fp8", "--out", str(out)]) == 0
    rows = read_table(out)
    assert [(r.dev_gib, r.precision) for r in rows] == [
        (0.25, "bf16"), (0.25, "fp8"), (0.5, "bf16"), (0.5, "fp8")]
    for r in rows:
        assert r.status == "ok" and r.tok_per_s > 0 and r.final_loss > 0, r
        plan = json.loads((out / "plans" / f"{r.plan_hash}.json").read_text())
        assert plan.get("precision", "bf16") == r.precision  # a bf16 plan omits its default
        assert r.log == f"logs/{SweepStore(out, by_precision=True).name(r.cell)}.log"
        assert (out / r.log).exists()
    first = {r.cell: r.run_id for r in rows}
    caplog.clear()
    assert main([*TINY, "--precision", "bf16,fp8", "--out", str(out)]) == 0
    assert "4 cell(s), 4 finished already" in caplog.text
    assert {r.cell: r.run_id for r in read_table(out)} == first
    (out / "cells" / "tiny-s128-h1-d0.5-fp8.json").unlink()  # as if killed in that cell
    caplog.clear()
    assert main([*TINY, "--precision", "bf16,fp8", "--out", str(out)]) == 0
    assert "4 cell(s), 3 finished already" in caplog.text
    assert "tiny s128 host 1 dev 0.5 fp8: ok" in caplog.text
    again = {r.cell: r for r in read_table(out)}
    rerun = [c for c, r in again.items() if r.run_id != first[c]]
    assert rerun == [Cell(model="tiny", seqlen=128, host_gib=1.0, dev_gib=0.5, precision="fp8")]
    assert again[rerun[0]].status == "ok"


def test_a_directory_refuses_a_resume_with_other_precisions_naming_what_to_pass(tmp_path,
                                                                                capsys, caplog):
    """A precision grid's directory refuses one precision (naming the list to pass), a
    one-precision directory refuses a list (naming its precision), and a bf16 directory refuses
    fp8 as before; each before any cell, leaving the records as they were."""
    grid, one = tmp_path / "g", tmp_path / "b"
    assert main([*PREDICT, "--precision", "bf16,fp8", "--out", str(grid)]) == 0
    assert main([*PREDICT, "--out", str(one)]) == 0
    before = {p: p.read_bytes() for d in (grid, one) for p in (d / "cells").iterdir()}
    capsys.readouterr()
    for precision, out, words in [
        ("bf16", grid, "holds a precision grid (cells in bf16, fp8 so far, named by precision); "
                       "run with --precision bf16,fp8 to resume it"),
        ("fp8", grid, "run with --precision bf16,fp8 to resume it, or give another --out for "
                      "--precision fp8"),
        ("fp8", one, "holds cells planned in bf16; run with --precision bf16 to resume it"),
        ("bf16,fp8", one, "holds a one-precision sweep (cells in bf16); run with --precision "
                          "bf16 to resume it, or give another --out for --precision bf16,fp8"),
        ("fp8,bf16", one, "run with --precision bf16 to resume it"),
    ]:
        assert main([*PREDICT, "--precision", precision, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err, (precision, err)
    assert {p: p.read_bytes() for d in (grid, one) for p in (d / "cells").iterdir()} == before
    caplog.set_level(logging.INFO, logger="dataflow.sweep")
    assert main([*PREDICT, "--precision", "fp8,bf16", "--out", str(grid)]) == 0  # order is free
    assert "4 finished already" in caplog.text


def test_a_table_from_before_the_precision_column_resumes_as_bf16_alone(tmp_path, capsys,
                                                                        caplog):
    """Records whose precision is empty (written before the column) are bf16 cells of a
    one-precision directory: a bf16 resume skips them, a list is refused naming bf16."""
    caplog.set_level(logging.INFO, logger="dataflow.sweep")
    out = tmp_path / "old"
    assert main([*PREDICT, "--out", str(out)]) == 0
    for path in (out / "cells").iterdir():
        row = json.loads(path.read_text())
        row["precision"] = None
        path.write_text(json.dumps(row))
    caplog.clear()
    assert main([*PREDICT, "--out", str(out)]) == 0
    assert "2 cell(s), 2 finished already" in caplog.text
    capsys.readouterr()
    assert main([*PREDICT, "--precision", "bf16,fp8", "--out", str(out)]) == 2
    assert "one-precision sweep (cells in bf16); run with --precision bf16" in \
        capsys.readouterr().err


def test_a_grid_directory_with_a_precision_the_list_leaves_out_is_refused(tmp_path):
    """The records' precisions must all be in the list asked for; the error names the one left
    out and the list that resumes (a partial grid, e.g. killed after its bf16 cells, resumes)."""
    config = SweepConfig(cells=(), out="DIR", precisions=("bf16", "xp"))
    _refuse_other_precisions(config, {"bf16"}, True)
    with pytest.raises(ConfigError, match=r"DIR holds cells planned in fp8, which --precision "
                                          r"bf16,xp leaves out; run with --precision "
                                          r"bf16,xp,fp8 to resume it"):
        _refuse_other_precisions(config, {"bf16", "fp8"}, True)


@pytest.mark.parametrize("extra, words", [
    (["--precision", "bf16,fp4"], "--precision: 'fp4' is not a precision; choose from bf16, fp8"),
    (["--precision", "bf16,fp8", "--lora-rank", "4"],
     "an FP8 base (fp8) is not supported with LoRA yet; use --precision bf16"),
    (["--precision", "fp8", "--lora-rank", "4"], "FP8 base (fp8)"),
])
def test_bad_precision_or_lora_on_fp8_exits_2_before_the_directory_is_made(tmp_path, capsys,
                                                                          extra, words):
    """An unknown precision, or LoRA with fp8 alone or in a list, exits 2 with one line naming
    the value and the way out; no sweep directory is created."""
    assert main([*TINY, *extra, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert not (tmp_path / "x").exists()


def test_a_precision_grid_plots_each_picture_once_per_precision(tmp_path):
    """A table of two precisions gets MODEL-SEQLEN-PRECISION-report.png for each; a table of
    one keeps MODEL-SEQLEN-report.png."""
    pytest.importorskip("matplotlib")

    assert main([*PREDICT, "--precision", "bf16,fp8", "--out", str(tmp_path / "g")]) == 0
    assert main([*PREDICT, "--precision", "fp8", "--out", str(tmp_path / "f")]) == 0
    assert sorted(p.name for p in plot_sweep(tmp_path / "g")) == [
        "8b-8192-bf16-report.png", "8b-8192-fp8-report.png"]
    assert [p.name for p in plot_sweep(tmp_path / "f")] == ["8b-8192-report.png"]
