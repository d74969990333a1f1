"""The real backend: a driver starts worker processes that execute a plan's Program with
real tensors. Importing this package imports neither torch.distributed nor DeepSpeed."""
