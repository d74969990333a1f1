"""DistMM (Huang et al., NSDI'24): per-tower partitioner, load balancer, placement and
pipeline Programs (planner.py is the entry)."""

# The real backend's refusals name plan fields (src.errors.PlanRefused); these options set them
# ({unit}: the unit the field belongs to; a unit-specific entry is 'unit.field').
PLAN_FIELDS = {
    "tp": "strategy.{unit}.tp",
    "pp": "strategy.{unit}.pp",
    "micro_batch": "strategy.microbatches",
    "recompute": "strategy.recompute",
    "zero_stage": "strategy.zero_stage",
}
