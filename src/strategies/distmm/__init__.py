"""DistMM (Huang et al., NSDI'24): per-tower partitioner, load balancer, placement and
pipeline Programs (planner.py is the entry)."""
