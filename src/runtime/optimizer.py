"""What every optimizer of a real run is built with (backend.deepspeed, backend.contrastive):
DeepSpeed's engines, the optimizers of units on a tensor grid and the single-process reference
build theirs here, so that any plan trains as one process does.

- The optimizer: torch.optim's AdamW, Adam (their fused kernels) or SGD over two parameter groups, the second
  (biases, normalisation layers' weights, the contrastive logit scale, as `no_decay` names
  them) without weight decay. DeepSpeed gets it as its client optimizer.
- The learning-rate schedule: one of DeepSpeed's warm-up schedulers, stepped after every
  applied update (DeepSpeed's engine steps its own; a grid's optimizer steps the same class).
- The logit scale: clamped to [0, ln logit_scale_max] after every update, as OpenCLIP does,
  in every copy DeepSpeed keeps of it (ZeRO's fp32 partitions too).
- Gradient clipping and the gradient norm: ZeRO-1/2/3 clip and take the norm inside
  DeepSpeed's step (gradient_clipping in the engine's config); at ZeRO-0 DeepSpeed's fp32
  path takes the norm and drops it, so the client optimizer's pre-step hook takes the norm
  (DeepSpeed's `get_grad_norm`, over the engine's tensor-parallel group) and clips.
  Each engine's norm covers its parameters over its data- and tensor-parallel groups;
  `norm_share` spreads it over those ranks, so that the shares of all ranks add up to the
  model's squared norm.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from src.config import ContrastiveSpec, DeepSpeedSpec, OptimizerSpec, SchedulerSpec
from src.runtime.modules.contrastive import ContrastiveLoss

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
# Adam and AdamW run torch's fused kernel, one pass over each parameter with its gradient and
# moments (CPU and CUDA); torch's default multi-tensor and per-tensor paths make several. On an
# H200 the fused step takes 0.43x the multi-tensor one's kernel time (1.7B GPT:
# benchmarks/results/small_gpt_h200.md); on a CPU about a ninth of the per-tensor one's.
FUSED = frozenset({"AdamW", "Adam"})


def new_optimizer(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The spec's optimizer over `groups`: every optimizer of a run is made here, so that all
    update their parameters with the same kernels (element for element the same arithmetic)."""
    kernels: dict[str, Any] = {"fused": True} if spec.type in FUSED else {}
    return OPTIMIZERS[spec.type](groups, **spec.params(), **kernels)


def exempt_from_decay(module: nn.Module, name: str, categories: Iterable[str]) -> bool:
    """Whether parameter `name` of `module` (its own, not a child's) is in one of the
    no_decay categories: a bias, a normalisation layer's, the logit scale."""
    categories = set(categories)
    return (
        ("bias" in categories and name == "bias")
        or ("norm" in categories and "Norm" in type(module).__name__)
        or ("logit_scale" in categories and name == "logit_scale")
    )


def parameter_groups(module: nn.Module, spec: OptimizerSpec) -> list[dict[str, Any]]:
    """The trained parameters of `module`: those decayed, then those exempt (no_decay)."""
    decayed: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            if param.requires_grad:
                (exempt if exempt_from_decay(owner, name, spec.no_decay) else decayed).append(param)
    return [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]


def build_optimizer(module: nn.Module, settings: DeepSpeedSpec, contrastive: ContrastiveSpec) -> torch.optim.Optimizer:
    """The optimizer of `module`'s trained parameters; it clamps the logit scale of each
    contrastive loss it holds after every update."""
    spec = settings.optimizer
    optimizer = new_optimizer(spec, parameter_groups(module, spec))
    scales = [m.logit_scale for m in module.modules() if isinstance(m, ContrastiveLoss) and m.logit_scale.requires_grad]
    if scales and contrastive.logit_scale_max is not None:
        top = math.log(contrastive.logit_scale_max)

        def clamp(*_: Any) -> None:
            for param in scales:
                clamp_parameter(param, 0.0, top)

        optimizer.register_step_post_hook(clamp)
    return optimizer


def clamp_parameter(param: nn.Parameter, low: float, high: float) -> None:
    """Clamp a parameter in place wherever this rank keeps it: the module's tensor and, under
    ZeRO, the fp32 partition the optimizer updates (a clamp is elementwise, so each rank
    clamps the elements it holds). Runs right after the optimizer's update: ZeRO then copies
    its fp32 partitions into the model's parameters."""
    param.data.clamp_(low, high)
    mapping = getattr(param, "_hp_mapping", None)  # ZeRO-1/2: the fragment of this rank's fp32 partition
    if mapping is not None:
        mapping.get_hp_fragment().data.clamp_(low, high)
    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition, and its fp32 copy
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        param.ds_tensor.data.clamp_(low, high)  # type: ignore[attr-defined]
        local = safe_get_local_fp32_param(param)
        if local is not None:
            safe_set_local_fp32_param(param, local.clamp(low, high))


def scheduler_params(spec: SchedulerSpec, steps: int) -> dict[str, Any]:
    """The scheduler's params as DeepSpeed takes them: total_num_steps, where the type takes
    one and the config leaves it null, is the run's train.steps."""
    if spec.type in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in spec.params:
        return {**spec.params, "total_num_steps": steps}
    return dict(spec.params)


def build_scheduler(optimizer: torch.optim.Optimizer, spec: SchedulerSpec | None, steps: int) -> Any:
    """DeepSpeed's scheduler class of `spec` over `optimizer`, for an optimizer no DeepSpeed
    engine steps (a grid's); None for a constant learning rate."""
    if spec is None:
        return None
    from deepspeed.runtime import lr_schedules

    return getattr(lr_schedules, spec.type)(optimizer, **scheduler_params(spec, steps))


def squared_norm(grads: list[torch.Tensor], counted: list[float]) -> torch.Tensor:
    """The sum of each gradient's squared norm times its count (fp64), in a few kernels for
    the whole list, not four a tensor: a 1.3B GPT's 292 tensors made 1168, each 6 us or more
    of a GPU host's time (benchmarks/results/amp_host_h200.json)."""
    norms = torch.stack(torch._foreach_norm([g.detach().float() for g in grads])).double()
    return (norms.square() * torch.tensor(counted, dtype=torch.float64, device=norms.device)).sum()


def tp_count(param: nn.Parameter, tp: int) -> float:
    """What a parameter's squared norm counts for in its TP group's: a parameter split over
    TP ranks (mark_tensor_parallel) each rank's slice whole, a replicated one once in all."""
    return 1.0 if getattr(param, "tensor_model_parallel", False) else 1.0 / tp


def grad_norm(params: list[nn.Parameter], tp_group: Any, tp: int) -> float:
    """The gradient norm of `params` over their tensor-parallel group (tp_count)."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    total = squared_norm([p.grad for p in params if p.grad is not None], [tp_count(p, tp) for p in params])
    if tp > 1:
        import torch.distributed as dist

        dist.all_reduce(total, group=tp_group)
    return float(total.sqrt())


def over_stages(norm: float, pp_group: Any, device: torch.device) -> float:
    """The model's gradient norm from this stage's (`norm`) and the other stages' (None: this
    engine holds the whole model). Every stage joins, whatever its norm (an inf or a NaN
    carries over)."""
    if pp_group is None:
        return norm
    import torch.distributed as dist

    total = torch.tensor(norm * norm, dtype=torch.float64, device=device)
    dist.all_reduce(total, group=pp_group)
    return float(total.sqrt())


def clip_to(max_norm: float, norm: float, grads: list[torch.Tensor]) -> None:
    """Scale gradients whose global norm is `norm` down to `max_norm` (> 0; else leave
    them), by DeepSpeed's and Megatron-LM's coefficient."""
    if max_norm > 0 and math.isfinite(norm):
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1:
            torch._foreach_mul_(grads, coefficient)


def attach_zero0_norm(engine: Any, max_norm: float) -> None:
    """At ZeRO-0, take the engine's gradient norm (and clip to `max_norm`, if > 0) as its
    client optimizer is about to update: DeepSpeed has reduced the gradients by then, and
    its own fp32 clipping would drop the norm. Kept where DeepSpeed's ZeRO stages keep
    theirs (engine.get_global_grad_norm())."""
    groups = engine.mpu

    def before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = grad_norm(params, groups.get_model_parallel_group(), groups.get_model_parallel_world_size())
        engine._global_grad_norm = norm  # the engine's own, as the step's metrics add it up
        if max_norm > 0:
            model_norm = over_stages(norm, groups.pp, engine.device)
            clip_to(max_norm, model_norm, [p.grad for p in params if p.grad is not None])

    engine.optimizer.register_step_pre_hook(before_step)


def mark_tensor_parallel(module: nn.Module) -> None:
    """Tell DeepSpeed's gradient norms which parameters are split over TP ranks (each rank's
    slice counts), as Megatron-LM marks them; the others are replicated on every TP rank
    and count once."""
    from src.runtime.modules.parallel import ColumnParallelLinear, RowParallelLinear

    for layer in module.modules():
        if isinstance(layer, ColumnParallelLinear) and layer.tp.size > 1:
            for param in layer.parameters(recurse=False):
                param.tensor_model_parallel = True  # type: ignore[attr-defined]
        elif isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
            layer.weight.tensor_model_parallel = True  # type: ignore[attr-defined]


def norm_share(norm: float, dp: int, tp: int) -> float:
    """This rank's share of the model's squared gradient norm for one engine whose norm
    (over its data- and tensor-parallel groups) is `norm`: every rank of those groups holds
    the same norm and adds its share."""
    return norm * norm / (dp * tp)
