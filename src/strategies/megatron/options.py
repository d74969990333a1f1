"""The Megatron-LM baseline's options (conf/strategy/megatron.yaml): each left null is
searched (megatron.space), each set is honoured or refused here in one line."""

from __future__ import annotations

from dataclasses import dataclass

from src.costmodel.memory import check_grad_dtype, check_memory_options
from src.config import check_positive, options_from
from src.errors import ConfigError
from src.models.spec import ModelSpec
from src.schedules.pipeline import SCHEDULES
from src.strategies.builders.pipeline import P2P_EXCHANGES
from src.strategies.builders.stages import main_unit

CHOOSE_ON = ("mean", "data")
# What the balanced cut equalises: each layer's FLOPs (Optimus Appendix B estimates a layer's
# time so) or its simulated time (host-bound layers priced as such).
BALANCE_BY = ("flops", "time")


@dataclass(frozen=True)
class MegatronChoices:
    """The choices of Megatron-LM's search a user may fix (None: searched). A strategy that
    plans one of its units with Megatron-LM takes them for that unit (Optimus: strategy.llm)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    vpp: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    zero_stage: int | None = None

    def options(self, where: str) -> MegatronOptions:
        """Megatron-LM's options with these choices, the rest at their defaults; `where`:
        the choices' place in the config, for the messages of their checks."""
        given = {key: value for key, value in vars(self).items() if value is not None}
        return options_from(MegatronOptions, given, prefix=where)


@dataclass(frozen=True)
class MegatronOptions(MegatronChoices):
    overlap_grad_reduce: bool = False
    # Megatron-Core's --overlap-param-gather: the distributed optimizer's parameter
    # all-gather, layer by layer, each waited for where the next forward first uses it.
    overlap_param_gather: bool = False
    modality_stages: str = "extra"
    uneven_pp: bool = False
    balance: bool = False
    balance_by: str = "flops"
    scatter_gather: bool = True
    # Units replicated over their stage's TP group (DistTrain §2.1): whole on each of its
    # ranks, each on its share of a micro-batch's rows.
    replicate: tuple[str, ...] = ()
    # mean: the plan chosen as Megatron-LM's users choose it, at the mean load; data: the
    # search's ranking priced on the workload's first batch under its balancing policy.
    choose_on: str = "mean"
    # The type data parallelism reduces gradients in; None: Megatron-LM's (fp32 for bf16,
    # which it forces, the precision's otherwise). DeepSpeed-3D sets DeepSpeed's.
    grad_reduce_dtype: str | None = None
    # Data parallelism all-reduces the whole gradient after the flush even where the optimizer
    # is sharded, which then gathers the updated parameters: DeepSpeed's pipeline engine
    # (_exec_reduce_grads, under ZeRO-1 and BF16_Optimizer alike), which DeepSpeed-3D sets.
    # Megatron-LM's distributed optimizer reduce-scatters instead.
    grad_all_reduce: bool = False
    # The type a second copy of the gradients accumulates in beside the kept ones (DeepSpeed's
    # BF16_Optimizer, which DeepSpeed-3D's bf16 runs set); None: none, as Megatron-LM.
    grad_accum_dtype: str | None = None
    # How stages exchange payloads (builders.pipeline.P2P_EXCHANGES): eager sends on a stream of
    # their own, or DeepSpeed's pipeline engine's synchronous ones in its step order, which
    # DeepSpeed-3D sets.
    p2p: str = "eager"
    # Warm-up forwards beyond 1F1B's on every stage but the last (schedules.pipeline): micro-batches
    # queued in front of a last stage whose micro-batches take unequal times (an MLLM's generator).
    extra_warmup: int = 0

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "vpp", "micro_batch_size"):
            check_positive(f"strategy.{key}", getattr(self, key), optional=True)
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError(f"strategy.schedule={self.schedule!r}; choose one of {list(SCHEDULES)} or null")
        if self.vpp is not None and self.vpp > 1 and self.schedule in ("gpipe", "1f1b"):
            raise ConfigError(f"strategy.vpp={self.vpp} needs the interleaved schedule, not strategy.schedule={self.schedule}")
        for key in (
            "sequence_parallel",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "uneven_pp",
            "balance",
            "scatter_gather",
            "grad_all_reduce",
        ):
            value = getattr(self, key)
            if not isinstance(value, bool) and not (key == "sequence_parallel" and value is None):
                raise ConfigError(f"strategy.{key} must be true or false, got {value!r}")
        if self.balance_by not in BALANCE_BY:
            raise ConfigError(f"strategy.balance_by={self.balance_by!r}; choose one of {list(BALANCE_BY)}")
        if self.balance_by != "flops" and not self.balance:
            raise ConfigError(
                f"strategy.balance_by={self.balance_by} prices the balanced cut's layers, which only strategy.balance=true makes "
                f"(Megatron-LM's own cut is by layer count)"
            )
        if self.balance and self.schedule == "gpipe":
            raise ConfigError(
                "strategy.balance=true runs the interleaved 1F1B schedule (Optimus Appendix B), not strategy.schedule=gpipe"
            )
        check_memory_options(
            self.recompute, self.zero_stage, "Megatron-LM's distributed optimizer is ZeRO stage 1 (stages 2-3 belong to strategy=ddp)"
        )
        if self.overlap_param_gather and self.zero_stage != 1:
            raise ConfigError(
                f"strategy.overlap_param_gather=true overlaps the distributed optimizer's parameter all-gather "
                f"(Megatron-LM requires --use-distributed-optimizer with it): it needs strategy.zero_stage=1, "
                f"got {self.zero_stage}"
            )
        check_grad_dtype("grad_reduce_dtype", self.grad_reduce_dtype)
        check_grad_dtype("grad_accum_dtype", self.grad_accum_dtype)
        if self.grad_all_reduce and (self.overlap_grad_reduce or self.overlap_param_gather):
            raise ConfigError(
                "strategy.grad_all_reduce=true reduces the whole gradient after the pipeline's flush (DeepSpeed's pipeline "
                "engine); it does not overlap the backward or the next forward: set strategy.overlap_grad_reduce and "
                "strategy.overlap_param_gather false"
            )
        if self.p2p not in P2P_EXCHANGES:
            raise ConfigError(f"strategy.p2p={self.p2p!r}; choose one of {list(P2P_EXCHANGES)}")
        if self.p2p == "deepspeed" and self.schedule != "1f1b":
            raise ConfigError(
                f"strategy.p2p=deepspeed exchanges in the order of DeepSpeed's TrainSchedule, a 1F1B without virtual "
                f"stages: set strategy.schedule=1f1b (got {self.schedule or 'null, which leaves it to the search'})"
            )
        if not isinstance(self.extra_warmup, int) or isinstance(self.extra_warmup, bool) or self.extra_warmup < 0:
            raise ConfigError(f"strategy.extra_warmup must be an integer of 0 or more, got {self.extra_warmup!r}")
        why = self._extra_warmup_refused()
        if self.extra_warmup and why:
            raise ConfigError(f"strategy.extra_warmup={self.extra_warmup} deepens 1F1B's warm-up: {why}")
        if self.choose_on not in CHOOSE_ON:
            raise ConfigError(f"strategy.choose_on={self.choose_on!r}; choose one of {list(CHOOSE_ON)}")
        if any(not isinstance(name, str) for name in self.replicate) or len(set(self.replicate)) != len(self.replicate):
            raise ConfigError(f"strategy.replicate takes unit names, each once, got {list(self.replicate)}")
        object.__setattr__(self, "replicate", tuple(self.replicate))

    def _extra_warmup_refused(self) -> str | None:
        """Why these options' schedule takes no extra warm-up forwards (None: it does)."""
        if self.schedule == "gpipe":
            return "GPipe runs every forward first"
        if self.schedule == "interleaved" or (self.vpp or 1) > 1:
            return (
                "an interleaved schedule's last stage also runs the chain's middle (its first chunk feeds stage 0's "
                "second), so the stages before it cannot queue ahead of it: set strategy.vpp=1"
            )
        if self.p2p == "deepspeed":
            return (
                "DeepSpeed's engine pairs each send with the neighbour's next step (strategy.p2p=deepspeed), "
                "which a deeper warm-up would wait on forever"
            )
        return None

    def check_replicate(self, model: ModelSpec) -> None:
        """A replicated unit is a pipeline stage of its own: a unit of the model other than
        the one the pipeline is cut from, under modality_stages=extra."""
        if not self.replicate:
            return
        what = f"strategy.replicate={list(self.replicate)}"
        names = [u.name for u in model.units]
        unknown = [name for name in self.replicate if name not in names]
        if unknown:
            raise ConfigError(f"{what}: {model.name} has no unit {unknown[0]!r} (its units: {', '.join(names)})")
        if model.interaction is not None:
            raise ConfigError(f"{what}: the Megatron-LM baseline of contrastive models ({model.name}) has no pipeline stages")
        if self.modality_stages != "extra" or self.balance:
            how = "strategy.balance=true" if self.balance else f"strategy.modality_stages={self.modality_stages}"
            raise ConfigError(
                f"{what} replicates units on pipeline stages of their own, which {how} does not give them "
                f"(it needs strategy.modality_stages=extra)"
            )
        main = main_unit(model).name
        if main in self.replicate:
            own = [name for name in names if name != main]
            raise ConfigError(
                f"{what}: {main} is cut into the pipeline's stages; only a unit on a stage of its own is replicated "
                f"({', '.join(own) or 'none here'})"
            )

    def searched(self, contrastive: bool) -> bool:
        """Whether any axis of the space is left to the planner."""
        axes = [self.tp, self.micro_batch_size, self.recompute, self.zero_stage]
        if not contrastive:
            axes += [
                self.pp,
                self.vpp if self.schedule not in ("gpipe", "1f1b") else 1,
                self.sequence_parallel if self.tp != 1 else False,
            ]
        return any(value is None for value in axes)
