"""What is trained: ModelSpecs per family (spec.py), built from `conf/model/` by registry.py."""

from src.models.registry import MODEL_NAMES, build_model

__all__ = ["MODEL_NAMES", "build_model"]
