"""Program builders every planner shares: rank layouts and routes, stage cuts, instruction
patterns, and the pipeline, colocated and contrastive emitters."""
