"""Par4D (Singh et al.): 3D tensor x data parallelism, its grid layouts, communication model
and Programs (planner.py is the entry)."""

# The real backend's refusals name plan fields (src.errors.PlanRefused); these options set them
# ({unit}: the unit the field belongs to; a unit-specific entry is 'unit.field').
PLAN_FIELDS = {
    "mesh": "strategy.grid",
    "micro_batch": "strategy.micro_batch_size",
    "recompute": "strategy.recompute",
}
