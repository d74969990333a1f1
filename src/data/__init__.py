"""Training data for the real backend: synthetic and deterministic from the seed, or real
image-caption shards. A dataset maps a global sample index to a dict of tensors, so every
rank can cut its own replica's micro-batches out of the same global batch."""
