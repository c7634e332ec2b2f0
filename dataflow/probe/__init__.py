"""dataflow-probe: measure this machine's copy, memory and compute rates with the engine's own
backend and kernels, and turn them into the HardwareProfile the planner reads.

`measure` runs on the GPU (CuPy); `profile` turns a `Measurements` into a profile and a table
and never touches a device; the console script is dataflow.cli.probe. See docs/planner.md
section 5."""
