"""Choosing a plan: the cost model, the candidate space and its fast round screen, the search,
plan building, explanation, ring planning and the multi-GPU layout. The top layer of the
planner (imports memplan.plan and memplan.step); never imports array libraries, never touches a
device."""
