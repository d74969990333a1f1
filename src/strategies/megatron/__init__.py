"""Megatron-LM, the baseline every paper compares against: the space its users set, the
estimate that prunes it, the search over simulations, and the Programs (planner.py is the entry)."""
