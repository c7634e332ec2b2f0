"""What a plan is: the Plan and its decisions, budgets and hardware profiles, the buffers and
memory map they imply, chunkings, segment and region names, and a ring rank's plan and layer
placement. The bottom layer of the planner: never imports memplan.step or memplan.search, never
imports array libraries."""
