"""mmdist: plan, simulate and run distributed training of multimodal models."""
