"""Optimus (Feng et al.): encoder work scheduled into the LLM pipeline's bubbles, its encoder
layouts, timeline, bubble scheduler and Programs (planner.py is the entry)."""

# The real backend's refusals name plan fields (src.errors.PlanRefused); these options set them
# ({unit}: the unit the field belongs to; a unit-specific entry is 'unit.field').
PLAN_FIELDS = {
    "llm.tp": "strategy.llm.tp",
    "llm.pp": "strategy.llm.pp",
    "llm.micro_batch": "strategy.llm.micro_batch_size",
    "llm.recompute": "strategy.llm.recompute",
    "llm.zero_stage": "strategy.llm.zero_stage",
    "llm.sequence_parallel": "strategy.llm.sequence_parallel",
    "tp": "strategy.encoder.tp",
    "pp": "strategy.encoder.pp",
    "zero_stage": "strategy.encoder_zero_stage",
    "kernels": "strategy.fine_grained",
}
