"""The console scripts (dataflow-demo, dataflow-plan, dataflow-sweep, dataflow-export,
dataflow-probe) and the argument checks and main() preamble they share: each module reads a
command line, hands validated values to the product packages and reports the outcome. No product
package imports this one (tests/test_layering.py); this package must never import anything
eagerly, so `python -m dataflow.cli.plan` loads only what the planner needs."""
