"""Megatron-LM, the baseline every paper compares against: the space its users set, the
estimate that prunes it, the search over simulations, and the Programs (planner.py is the entry)."""

# The real backend's refusals name plan fields (src.errors.PlanRefused); these options set them
# ({unit}: the unit the field belongs to; a unit-specific entry is 'unit.field').
PLAN_FIELDS = {
    "tp": "strategy.tp",
    "pp": "strategy.pp",
    "micro_batch": "strategy.micro_batch_size",
    "recompute": "strategy.recompute",
    "zero_stage": "strategy.zero_stage",
    "sequence_parallel": "strategy.sequence_parallel",
    "blocking": "strategy.overlap_grad_reduce",
    "scatter": "strategy.scatter_gather",
    "rows": "strategy.replicate",
}
