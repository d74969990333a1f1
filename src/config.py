"""Typed run configuration, built and validated once at the door."""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import os
import types
from pathlib import Path
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from omegaconf import DictConfig

from src.cluster import ClusterSpec
from src.errors import ConfigError, reject_unknown

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class TrainSpec:
    global_batch: int
    contrastive_batch: int
    seq_len: int | None
    precision: str
    steps: int
    seed: int
    # What the samples hold, the workload's for every strategy of a comparison: "uniform"
    # (every sample alike) or "interleaved" (an MLLM's LAION-like sequences whose image count
    # and sizes vary, src/data/interleaved.py).
    data: str = "uniform"
    # How the step's sequences are placed over replicas and micro-batches (src/data/balance.py):
    # one of BALANCE_POLICIES, or None for the strategy's own (DistTrain reorders, the others keep
    # the data order).
    balance: str | None = None


BALANCE_POLICIES = ("none", "reorder", "cost")
TOP_LEVEL = ("model", "strategy", "cluster", "backend", "logger", "train", "run", "plan")
TRAIN_KEYS = (
    "global_batch",
    "contrastive_batch",
    "seq_len",
    "precision",
    "steps",
    "seed",
    "data",
    "balance",
    "checkpoint_every",
    "resume",
)
RUN_KEYS = ("name", "out_root")
LOGGER_KEYS = {"none": ("name",), "wandb": ("name", "mode", "project", "entity", "group", "tags")}
WANDB_MODES = ("offline", "online", "disabled")
WANDB_ENV_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}
DIST_BACKENDS = ("gloo", "nccl", "auto")
DATA_ERRORS = ("fail", "skip")  # a bad shard or member fails the run, or is left out (webdataset's habit)
PREPROCESS = ("inline", "disaggregated")  # DistTrain: batches made by the trainer, or by a producer process beside it


def check_positive(name: str, value: Any, optional: bool = False, meaning: str = "") -> None:
    """A count a user sets (a degree, a batch, a number of chunks): a positive integer, or
    null where `optional`; else one line naming it (`meaning`: what 1 means, where it says more)."""
    if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return
    raise ConfigError(f"{name} must be a positive integer{' or null' if optional else ''}{meaning}, got {value!r}")


def positive_int(cfg: Mapping[str, Any], key: str, prefix: str) -> int:
    value = cfg.get(key)
    check_positive(f"{prefix}.{key}", value)
    return typing.cast(int, value)


def requested_precision(cfg: Mapping[str, Any], cluster: ClusterSpec) -> str:
    """train.precision as a run asks for it: `auto` (the default) is the cluster preset's;
    train_from_config checks the rest."""
    precision = cfg.get("precision", "auto")
    return cluster.default_precision if precision == "auto" else precision


def train_from_config(
    cfg: Mapping[str, Any], cluster: ClusterSpec, default_batch: int | None = None, data: tuple[str, ...] = ("uniform",)
) -> TrainSpec:
    """`default_batch` (the model's) stands in for a null train.global_batch; `data`: the
    contents the model's samples can hold, its default first (a null train.data)."""
    reject_unknown(cfg, TRAIN_KEYS, "train key(s)")
    if cfg.get("global_batch") is None and default_batch is not None:
        cfg = {**cfg, "global_batch": default_batch}
    global_batch = positive_int(cfg, "global_batch", "train")
    contrastive = cfg.get("contrastive_batch")
    if contrastive is None:
        contrastive = global_batch
    check_positive("train.contrastive_batch", contrastive)
    if contrastive > global_batch:
        raise ConfigError(f"train.contrastive_batch={contrastive} exceeds train.global_batch={global_batch}")
    seq_len = cfg.get("seq_len")
    if seq_len is not None:
        seq_len = positive_int(cfg, "seq_len", "train")
    precision = requested_precision(cfg, cluster)
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}; choose one of {list(PRECISIONS)} or auto")
    cluster.peak(precision)
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"train.seed must be a non-negative integer, got {seed!r}")
    content = cfg.get("data") or data[0]
    if content not in data:
        raise ConfigError(f"train.data={content!r}: this model's samples hold {' or '.join(data)} data")
    balance = cfg.get("balance")
    if balance is not None and balance not in BALANCE_POLICIES:
        raise ConfigError(f"train.balance={balance!r}; choose one of {list(BALANCE_POLICIES)} (null: the strategy's own)")
    return TrainSpec(
        global_batch=global_batch,
        contrastive_batch=contrastive,
        seq_len=seq_len,
        precision=precision,
        steps=positive_int(cfg, "steps", "train"),
        seed=seed,
        data=content,
        balance=balance,
    )


@dataclass(frozen=True)
class CheckpointSpec:
    """train.checkpoint_every and train.resume: how a real run saves its state and where it
    starts from. Not part of the plan (a resumed run runs the plan it resumes)."""

    every: int | None = None  # save after every N-th step (RUN_DIR/checkpoint); None: never
    resume: str | None = None  # a run directory (absolute) whose latest checkpoint this run starts from


def checkpoint_from_config(cfg: Mapping[str, Any], backend: str) -> CheckpointSpec:
    every, resume = cfg.get("checkpoint_every"), cfg.get("resume")
    if every is None and resume is None:
        return CheckpointSpec()
    if backend != "torch":
        raise ConfigError(f"train.checkpoint_every and train.resume are the real backend's (backend=torch), not backend={backend}'s")
    if every is not None:
        every = positive_int(cfg, "checkpoint_every", "train")
    if resume is not None:
        if not isinstance(resume, str) or not resume:
            raise ConfigError(f"train.resume must be a run directory, got {resume!r}")
        resume = os.path.abspath(resume)  # workers may start elsewhere (a launcher's nodes)
    return CheckpointSpec(every, resume)


OPTIMIZERS = ("AdamW", "Adam", "SGD")  # torch.optim's, as DeepSpeed names them
NO_DECAY = ("bias", "norm", "logit_scale")  # what no_decay may exempt from weight decay
# DeepSpeed's warm-up schedulers (deepspeed.runtime.lr_schedules) and the parameters each takes.
SCHEDULERS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}
WARMUP_TYPES = ("log", "linear")


@dataclass(frozen=True)
class OptimizerSpec:
    """backend.deepspeed.optimizer: the optimizer every engine builds (type and params as in
    DeepSpeed's config) and which parameters take no weight decay."""

    type: str = "AdamW"
    lr: float = 1.0e-3
    betas: tuple[float, float] = (0.9, 0.999)  # Adam, AdamW
    eps: float = 1.0e-8  # Adam, AdamW
    weight_decay: float = 0.0
    momentum: float = 0.0  # SGD
    # Parameters exempt from weight decay: biases, normalisation layers' weights, the
    # contrastive logit scale (OpenCLIP's and Megatron-LM's rule: every parameter of fewer
    # than two dimensions).
    no_decay: tuple[str, ...] = NO_DECAY

    def params(self) -> dict[str, Any]:
        """The torch.optim constructor's keyword arguments."""
        if self.type == "SGD":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass(frozen=True)
class SchedulerSpec:
    """backend.deepspeed.scheduler: one of DeepSpeed's warm-up schedulers and its params
    (total_num_steps, where it takes one, defaults to train.steps)."""

    type: str
    params: dict[str, Any]


@dataclass(frozen=True)
class LossScaleSpec:
    """backend.deepspeed.fp16: dynamic loss scaling under train.precision=fp16 (DeepSpeed's names)."""

    initial_scale_power: int = 16  # the scale starts at 2^power
    loss_scale_window: int = 1000  # steps without an overflow before the scale doubles
    min_loss_scale: float = 1.0  # an overflow halves the scale down to this


@dataclass(frozen=True)
class DeepSpeedSpec:
    """backend.deepspeed: the training settings merged into each DeepSpeed engine's config
    (and kept by the optimizers of Par4D's grid units, which run without DeepSpeed)."""

    optimizer: OptimizerSpec = OptimizerSpec()
    scheduler: SchedulerSpec | None = None  # None: a constant learning rate
    gradient_clipping: float = 0.0  # the gradients' global norm clipped to this (0: never)
    fp16: LossScaleSpec = LossScaleSpec()


@dataclass(frozen=True)
class ContrastiveSpec:
    """backend.contrastive: how the contrastive models train (OpenCLIP's defaults)."""

    logit_scale_max: float | None = 100.0  # exp(logit_scale) clamped to [1, this] after each step; None: never
    caption_loss_weight: float = 2.0  # CoCa: the captioning loss's weight ...
    contrastive_loss_weight: float = 1.0  # ... and the contrastive loss's
    pad_id: int | None = 0  # CoCa: caption tokens of this id are not scored; None: every token is


@dataclass(frozen=True)
class TorchBackendSpec:
    """The real backend's settings, checked at the door before any worker starts."""

    workers: int
    dist_backend: str
    timeout_s: float
    threads_per_worker: int
    data: str
    data_errors: str
    preprocess: str
    prefetch_steps: int
    deepspeed: DeepSpeedSpec = DeepSpeedSpec()
    contrastive: ContrastiveSpec = ContrastiveSpec()


def _number(cfg: Mapping[str, Any], key: str, prefix: str, minimum: float, strict: bool) -> float:
    value = cfg.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
        or (strict and value == minimum)
    ):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ConfigError(f"{prefix}.{key} must be a number {bound}, got {value!r}")
    return float(value)


def _section(cfg: Any, prefix: str, keys: typing.Iterable[str]) -> Mapping[str, Any]:
    """A mapping of settings under `prefix`, its keys among `keys`."""
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{prefix} takes a mapping of settings, got {cfg!r} (e.g. {prefix}.{next(iter(keys))}=...)")
    reject_unknown(cfg, keys, f"{prefix} key(s)")
    return cfg


def _optional(cfg: Mapping[str, Any], key: str, default: Any, check: typing.Callable[[], Any]) -> Any:
    return default if cfg.get(key) is None else check()


def _integer(cfg: Mapping[str, Any], key: str, prefix: str, minimum: int) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{prefix}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def optimizer_from_config(cfg: Any, prefix: str) -> OptimizerSpec:
    cfg = _section(cfg, prefix, ("type", "params", "no_decay"))
    kind = cfg.get("type", OptimizerSpec.type)
    if kind not in OPTIMIZERS:
        raise ConfigError(f"{prefix}.type={kind!r}: the real backend builds {', '.join(OPTIMIZERS)} (torch.optim's)")
    at = f"{prefix}.params"
    params = _section(cfg.get("params"), at, ("lr", "betas", "eps", "weight_decay", "momentum"))
    default = OptimizerSpec()
    # The config group lists every type's params at their defaults; one of another type's set
    # to something else would be read by nobody.
    foreign = {"betas": default.betas, "eps": default.eps} if kind == "SGD" else {"momentum": default.momentum}
    for key, value in foreign.items():
        given = params.get(key)
        if given is not None and (list(given) if isinstance(given, (list, tuple)) else given) != (
            list(value) if isinstance(value, tuple) else value
        ):
            raise ConfigError(f"{at}.{key}={given!r}: {kind} takes no {key} (it is {'SGD' if kind != 'SGD' else 'Adam'}'s)")
    betas = params.get("betas")
    if betas is not None and (
        not isinstance(betas, (list, tuple))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    ):
        raise ConfigError(f"{at}.betas must be two numbers in [0, 1), got {betas!r}")
    no_decay = cfg.get("no_decay", list(NO_DECAY))
    if not isinstance(no_decay, (list, tuple)) or not set(no_decay) <= set(NO_DECAY):
        raise ConfigError(f"{prefix}.no_decay must be a list of {list(NO_DECAY)} (or []), got {no_decay!r}")
    return OptimizerSpec(
        type=kind,
        lr=_optional(params, "lr", default.lr, lambda: _number(params, "lr", at, 0, strict=True)),
        betas=default.betas if betas is None else (float(betas[0]), float(betas[1])),
        eps=_optional(params, "eps", default.eps, lambda: _number(params, "eps", at, 0, strict=True)),
        weight_decay=_optional(params, "weight_decay", 0.0, lambda: _number(params, "weight_decay", at, 0, strict=False)),
        momentum=_optional(params, "momentum", 0.0, lambda: _number(params, "momentum", at, 0, strict=False)),
        no_decay=tuple(dict.fromkeys(no_decay)),
    )


def scheduler_from_config(cfg: Any, prefix: str) -> SchedulerSpec | None:
    """The config group lists every scheduler's params (null: DeepSpeed's default); those
    the chosen type does not take must stay null."""
    cfg = _section(cfg, prefix, ("type", "params"))
    kind = cfg.get("type")
    at = f"{prefix}.params"
    given = {k: v for k, v in _section(cfg.get("params"), at, sorted(set().union(*SCHEDULERS.values()))).items() if v is not None}
    if kind is None:
        if given:
            raise ConfigError(f"{at} sets {sorted(given)} but {prefix}.type is null (a constant lr): name the scheduler")
        return None
    if kind not in SCHEDULERS:
        raise ConfigError(f"{prefix}.type={kind!r}; choose one of DeepSpeed's {list(SCHEDULERS)} or null (a constant lr)")
    foreign = sorted(set(given) - set(SCHEDULERS[kind]))
    if foreign:
        raise ConfigError(f"{at}: {kind} takes no {foreign} (its params: {list(SCHEDULERS[kind])})")
    params: dict[str, Any] = {}
    for key, value in given.items():
        if key in ("total_num_steps", "warmup_num_steps"):
            params[key] = _integer(given, key, at, 1)
        elif key == "warmup_type":
            if value not in WARMUP_TYPES:
                raise ConfigError(f"{at}.warmup_type={value!r}; choose one of {list(WARMUP_TYPES)}")
            params[key] = value
        else:
            params[key] = _number(given, key, at, 0, strict=False)
    return SchedulerSpec(kind, params)


def loss_scale_from_config(cfg: Any, prefix: str) -> LossScaleSpec:
    cfg = _section(cfg, prefix, [f.name for f in dataclasses.fields(LossScaleSpec)])
    default = LossScaleSpec()
    return LossScaleSpec(
        initial_scale_power=_optional(
            cfg, "initial_scale_power", default.initial_scale_power, lambda: _integer(cfg, "initial_scale_power", prefix, 0)
        ),
        loss_scale_window=_optional(
            cfg, "loss_scale_window", default.loss_scale_window, lambda: _integer(cfg, "loss_scale_window", prefix, 1)
        ),
        min_loss_scale=_optional(cfg, "min_loss_scale", 1.0, lambda: _number(cfg, "min_loss_scale", prefix, 0, strict=True)),
    )


def deepspeed_from_config(cfg: Any, prefix: str = "backend.deepspeed") -> DeepSpeedSpec:
    """backend.deepspeed, typed: DeepSpeed's config names, every value checked."""
    cfg = _section(cfg, prefix, [f.name for f in dataclasses.fields(DeepSpeedSpec)])
    return DeepSpeedSpec(
        optimizer=optimizer_from_config(cfg.get("optimizer"), f"{prefix}.optimizer"),
        scheduler=scheduler_from_config(cfg.get("scheduler"), f"{prefix}.scheduler"),
        gradient_clipping=_optional(cfg, "gradient_clipping", 0.0, lambda: _number(cfg, "gradient_clipping", prefix, 0, strict=False)),
        fp16=loss_scale_from_config(cfg.get("fp16"), f"{prefix}.fp16"),
    )


def contrastive_from_config(cfg: Any, prefix: str = "backend.contrastive") -> ContrastiveSpec:
    cfg = _section(cfg, prefix, [f.name for f in dataclasses.fields(ContrastiveSpec)])
    pad = cfg.get("pad_id")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
        raise ConfigError(f"{prefix}.pad_id must be a token id >= 0 or null, got {pad!r}")
    top = cfg.get("logit_scale_max")
    return ContrastiveSpec(
        logit_scale_max=None if top is None else _number(cfg, "logit_scale_max", prefix, 1, strict=False),
        caption_loss_weight=_number(cfg, "caption_loss_weight", prefix, 0, strict=False),
        contrastive_loss_weight=_number(cfg, "contrastive_loss_weight", prefix, 0, strict=False),
        pad_id=pad,
    )


def backend_from_config(cfg: Mapping[str, Any]) -> TorchBackendSpec | None:
    """The torch backend's settings (None for the simulator, which has none)."""
    if cfg.get("name") != "torch":
        reject_unknown(cfg, ("name",), f"backend={cfg.get('name')} key(s)")
        return None
    fields = [f.name for f in dataclasses.fields(TorchBackendSpec)]
    reject_unknown(cfg, ["name", *fields], "backend key(s)")
    if cfg.get("dist_backend") not in DIST_BACKENDS:
        raise ConfigError(f"backend.dist_backend={cfg.get('dist_backend')!r}; choose one of {list(DIST_BACKENDS)}")
    if not isinstance(cfg.get("data"), str) or not cfg["data"]:
        raise ConfigError(f"backend.data must be 'synthetic' or a glob of tar shards, got {cfg.get('data')!r}")
    if cfg.get("data_errors") not in DATA_ERRORS:
        raise ConfigError(f"backend.data_errors={cfg.get('data_errors')!r}; choose one of {list(DATA_ERRORS)}")
    if cfg.get("preprocess") not in PREPROCESS:
        raise ConfigError(f"backend.preprocess={cfg.get('preprocess')!r}; choose one of {list(PREPROCESS)}")
    return TorchBackendSpec(
        workers=positive_int(cfg, "workers", "backend"),
        dist_backend=cfg["dist_backend"],
        timeout_s=_number(cfg, "timeout_s", "backend", 0, strict=True),
        threads_per_worker=positive_int(cfg, "threads_per_worker", "backend"),
        data=cfg["data"],
        data_errors=cfg["data_errors"],
        preprocess=cfg["preprocess"],
        prefetch_steps=positive_int(cfg, "prefetch_steps", "backend"),
        deepspeed=deepspeed_from_config(cfg.get("deepspeed")),
        contrastive=contrastive_from_config(cfg.get("contrastive")),
    )


def wandb_mode(logger: Mapping[str, Any]) -> str:
    """logger.mode where the command line sets it; else WANDB_MODE from the environment, as
    W&B documents it (its `run` is online, `dryrun` offline); else offline."""
    mode = logger.get("mode")
    if mode is not None:
        if mode not in WANDB_MODES:
            raise ConfigError(f"logger.mode={mode!r}; choose one of {list(WANDB_MODES)}")
        return mode
    env = os.environ.get("WANDB_MODE") or "offline"
    if env not in WANDB_ENV_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} in the environment; choose one of {list(WANDB_ENV_MODES)} (or set logger.mode)")
    return WANDB_ENV_MODES[env]


def check_logger_and_run(logger: Mapping[str, Any], run: Mapping[str, Any]) -> None:
    name = logger.get("name")
    if name not in LOGGER_KEYS:
        raise ConfigError(f"logger={name!r}; choose one of {sorted(LOGGER_KEYS)}")
    reject_unknown(logger, LOGGER_KEYS[name], f"logger={name} key(s)")
    if name == "wandb":
        wandb_mode(logger)
        tags = logger.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise ConfigError(f"logger.tags must be a list of strings, got {tags!r}")
    reject_unknown(run, RUN_KEYS, "run key(s)")


Options = TypeVar("Options", bound="DataclassInstance")


def options_from(cls: type[Options], cfg: Mapping[str, Any], prefix: str = "strategy") -> Options:
    """Fill a strategy's options dataclass from its config group; unknown keys are errors
    (a typo must not silently fall back to a default). A field whose type is itself an
    options dataclass (a unit's options, `strategy.encoder`) is filled the same way from
    its mapping; null gives that type's defaults."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown({k: v for k, v in cfg.items() if k != "name"}, fields, f"{prefix} option(s)")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in cfg.items():
        if key not in fields:
            continue
        nested = hints[key] if dataclasses.is_dataclass(hints[key]) else None
        if nested is not None:
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{prefix}.{key} takes a mapping of settings, got {value!r} (e.g. {prefix}.{key}.tp=2)")
            value = options_from(nested, value or {}, f"{prefix}.{key}")
        elif value is not None:
            _check_shape(f"{prefix}.{key}", value, hints[key])
        values[key] = value
    return cls(**values)


@dataclass(frozen=True)
class UnitCounts:
    """Base of a unit's options set by hand whose fields are all counts (degrees, micro-batch
    sizes): each a positive integer, or None for the planner's choice."""

    def check(self, where: str) -> None:
        """`where`: the options' place in the config (strategy.vision), for the message."""
        for field in dataclasses.fields(self):
            check_positive(f"{where}.{field.name}", getattr(self, field.name), optional=True)


def _check_shape(key: str, value: Any, hint: Any) -> None:
    """A list where the option takes one value, or one value where it takes a list or a
    mapping, is refused here; the planners check the values themselves."""
    args = (
        [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else [hint]
    )
    origins = {typing.get_origin(a) or a for a in args}
    if origins & {list, tuple}:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} takes a list, got {value!r} (e.g. {key}=[...])")
    elif origins & {Mapping, dict, collections.abc.Mapping}:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} takes a mapping of settings, got {value!r} (e.g. {key}.tp=2)")
    elif origins <= {int, float, str, bool} and isinstance(value, (list, tuple, Mapping)):
        raise ConfigError(f"{key} takes one value, got {value!r}")


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """A composed config as plain dicts and lists with interpolations resolved: what the
    validators take and resolved.yaml records."""
    from omegaconf import OmegaConf

    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def group_options(group: str, roots: Sequence[Path] = (CONF_DIR,)) -> list[str]:
    """The options of config group `group`: its YAML files under each root's `group/`."""
    return sorted({p.stem for root in roots for p in (root / group).glob("*.yaml")})


def unknown_option(args: Sequence[str], config_name: str = "config") -> str | None:
    """The first override naming an option its config group has no file for (`model=clp`;
    each of a multirun's `+experiment=a,b`), as the one line the doors print, or None. Hydra
    reports it in several lines and exits 1, and a multirun reaches Hydra before any check of
    ours. Hydra's own groups (hydra/..., which its plugins extend), keys (`model.layers=`)
    and sweep functions (`choice(...)`) are left to Hydra; so is every option where
    `hydra.searchpath` adds config directories other than local ones (a package's)."""
    roots = [CONF_DIR]
    for arg in args:
        if arg.lstrip("+").startswith("hydra.searchpath="):
            entries = [e.strip() for e in arg.partition("=")[2].strip("[]").split(",") if e.strip()]
            if not all(e.startswith("file://") for e in entries):
                return None
            roots += [Path(e.removeprefix("file://")) for e in entries]
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~")
        if not sep or arg.startswith("-") or group.startswith("hydra") or "(" in value:
            continue
        if not any((root / group).is_dir() for root in roots):
            continue
        options = group_options(group, roots)
        for option in value.split(","):
            if option not in options and option != "null":
                return f"In '{config_name}': Could not find '{group}/{option}'; choose one of {', '.join(options)}"
    return None


def composed(overrides: list[str]) -> dict[str, Any]:
    """The project's config composed with `overrides`, as plain_config gives it: what a
    tool or benchmark hands `src.setup.validate` without going through the front door."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return plain_config(compose(config_name="config", overrides=overrides))
