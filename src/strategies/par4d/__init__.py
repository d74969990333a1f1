"""Par4D (Singh et al.): 3D tensor x data parallelism, its grid layouts, communication model
and Programs (planner.py is the entry)."""
