"""DistTrain (Zhang et al., arXiv 2408.04275): disaggregated encoder, LLM and generator units,
their orchestration, data reordering and Programs (planner.py is the entry)."""

# The real backend's refusals name plan fields (src.errors.PlanRefused); these options set them
# ({unit}: the unit the field belongs to; a unit-specific entry is 'unit.field').
PLAN_FIELDS = {
    "tp": "strategy.{unit}.tp",
    "pp": "strategy.{unit}.pp",
    "recompute": "strategy.{unit}.recompute",
    "zero_stage": "strategy.{unit}.zero_stage",
    "sequence_parallel": "strategy.{unit}.sequence_parallel",
    "scatter": "strategy.{unit}.scatter_gather",
    "fraction": "strategy.tp_overlap_chunks",
}
