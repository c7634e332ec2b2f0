"""`dataflow-sweep`: memory x throughput sweeps. Runs the demo's engine once per cell of a grid of
host and device budgets (each cell in a fresh process), keeps one resumable, versioned table of
the results and draws ml_dataflow-style heatmaps from it (its command line: dataflow.cli.sweep).
See docs/sweep.md.

Never decides placement (the planner does) and never trains in its own process: a cell's engine
always runs in a child process, so one cell's memory cannot leak into the next one's numbers."""
