"""DistTrain (Zhang et al., arXiv 2408.04275): disaggregated encoder, LLM and generator units,
their orchestration, data reordering and Programs (planner.py is the entry)."""
