"""Every config option composes and validates (lightning-hydra-template style).

With Hydra's compose API, each option of each group (model/*, strategy/*, cluster/*,
backend/*, logger/*) is composed into the full config and validated by the code the run
uses: cluster presets through `cluster_from_config`, models through `build_model`,
(model, cluster) pairs through `train_from_config`, strategies through their planner's
options. Cluster presets are also read as plain YAML: every field stated (no silent
default), the numbers positive, the sources given.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from src.errors import ConfigError
from src.cluster import FLOAT_FIELDS, ClusterSpec, cluster_from_config, unsourced
from src.config import PRECISIONS, TrainSpec, options_from, train_from_config
from src.config import composed as hydra_composed
from src.models.registry import MODEL_NAMES, build_model
from src.models.spec import ModelSpec
from src.setup import validate
from src.sweep import figure_jobs, find_sweep_file, load_sweep
from src.strategies import STRATEGIES, planner_for
from tests.composing import composed

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("model", "strategy", "cluster", "backend", "logger")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_config(*overrides: str) -> dict[str, Any]:
    """The run's config as a plain dict, resolved, exactly as run.py gets it (a fresh one
    each call; tests/composing.py composes each set of group choices once)."""
    return composed(overrides)


def strategy_options(name: str) -> type:
    """The options dataclass strategy `name`'s descriptor reads its config group with."""
    options = STRATEGIES[name].options
    assert options is not None, f"strategy {name} declares no options dataclass"
    return options


ALL_OPTIONS = [(group, name) for group in GROUPS for name in options(group)]
# The collective library's protocol tables are stated as one `collectives` block.
CLUSTER_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ClusterSpec) if f.name not in ("ring_protocols", "tree_protocols"))
# Stated in every preset though not ClusterSpec fields: the optional size check, the host profile, the protocol tables.
CLUSTER_EXTRA_FIELDS = ("devices", "profile", "collectives")
BANDWIDTHS = ("memory_bandwidth", "intra_bandwidth", "inter_bandwidth")


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"
    # The groups and options docs/running.md lists (tests/test_docs.py checks it names every one).
    assert set(options("model")) >= {"clip", "coca", "lit", "mllm_9b", "mllm_15b", "mllm_72b", "optimus", "gpt", "unet"}
    assert set(options("cluster")) >= {"p3_16xlarge", "a800", "hopper", "perlmutter", "frontier", "dgx_a100", "local"}
    assert set(options("logger")) >= {"wandb", "none"}


# --------------------------------------------------------------------------- each option


@pytest.mark.parametrize("group,name", ALL_OPTIONS, ids=[f"{g}={n}" for g, n in ALL_OPTIONS])
def test_option_composes(group: str, name: str) -> None:
    config = compose_config(f"{group}={name}")
    for g in GROUPS + ("train", "run"):
        assert g in config, f"{group}={name}: the composed config lacks {g}"
    assert config[group]["name"] == name, f"conf/{group}/{name}.yaml has name {config[group].get('name')!r}"
    # tests/composing.py composes a set of choices group by group: an option touches its own node only.
    outside = {key: value for key, value in config.items() if key not in (group, "run")}
    assert outside == {key: value for key, value in compose_config().items() if key not in (group, "run")}, (
        f"conf/{group}/{name}.yaml sets values outside {group}"
    )
    # ${model.name}-${strategy.name}-${cluster.name}
    assert config["run"]["name"] == f"{config['model']['name']}-{config['strategy']['name']}-{config['cluster']['name']}"


@pytest.mark.parametrize("name", options("cluster"))
def test_cluster_preset_builds(name: str) -> None:
    config = compose_config(f"cluster={name}")
    cluster = cluster_from_config(config["cluster"])
    assert isinstance(cluster, ClusterSpec)
    assert cluster.name == name
    assert cluster.devices == cluster.nodes * cluster.devices_per_node > 0
    peak = cluster.peak(cluster.default_precision)
    assert math.isfinite(peak) and peak > 0
    assert cluster.default_precision in PRECISIONS
    assert cluster.sources, f"cluster {name} has no sources entry"
    assert all(str(v).strip() for v in cluster.sources.values()), cluster.sources
    assert cluster.usable_memory_bytes > 0


@pytest.mark.parametrize("name", options("model"))
def test_model_builds(name: str) -> None:
    config = compose_config(f"model={name}")
    assert name in MODEL_NAMES
    model = build_model(config["model"], config["train"]["seq_len"])
    assert isinstance(model, ModelSpec)
    assert model.name == name
    assert model.units, f"model {name} has no units"
    assert model.params > 0


@pytest.mark.parametrize("name", options("strategy"))
def test_strategy_options_validate(name: str) -> None:
    config = compose_config(f"strategy={name}")
    assert STRATEGIES[name].name == name, f"conf/strategy/{name}.yaml is described as {STRATEGIES[name].name!r}"
    assert callable(planner_for(name))
    # Every key of the yaml is an option the planner reads (unknown keys are errors), and
    # the defaults pass the options' own validation.
    options_from(strategy_options(name), config["strategy"])


def _same_default(yaml_value: Any, default: Any) -> bool:
    """A YAML list is a tuple option's value; a per-unit mapping is its options dataclass,
    key by key (every dataclass field written, none more)."""
    if isinstance(yaml_value, dict):
        assert dataclasses.is_dataclass(default), f"a mapping {yaml_value!r} where the dataclass default is {default!r}"
        fields = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
        return set(yaml_value) == set(fields) and all(_same_default(yaml_value[k], fields[k]) for k in fields)
    if isinstance(yaml_value, list):
        return isinstance(default, (list, tuple)) and len(yaml_value) == len(default) and all(map(_same_default, yaml_value, default))
    return yaml_value == default and type(yaml_value) is type(default)


def check_yaml_defaults(path: Path, options: type) -> None:
    """The YAML file a user reads names every option at the value the planner takes when it is left out."""
    shown = f"{path.parent.name}/{path.name}"
    written = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k != "name"}
    fields = {f.name: f for f in dataclasses.fields(options)}
    assert sorted(written) == sorted(fields), f"{shown} names {sorted(written)}, its options {sorted(fields)}"
    for key, field in fields.items():
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert default is not dataclasses.MISSING, f"strategy.{key} has no default in {options.__name__}"
        assert _same_default(written[key], default), f"{shown}: {key}={written[key]!r}, its dataclass default {default!r}"


@pytest.mark.parametrize("name", options("strategy"))
def test_every_strategy_yaml_default_is_its_options_dataclass_default(name: str) -> None:
    check_yaml_defaults(CONF / "strategy" / f"{name}.yaml", strategy_options(name))


@pytest.mark.parametrize("name", options("backend"))
def test_backend_is_available(name: str) -> None:
    config = compose_config(f"backend={name}")
    assert config["backend"]["name"] == name
    # The run's own door check (src/run.py validate): an unknown backend is a ConfigError.
    setup = validate(config)
    assert setup.config["backend"]["name"] == name


@pytest.mark.parametrize("name", options("logger"))
def test_logger_option(name: str) -> None:
    config = compose_config(f"logger={name}")
    assert config["logger"]["name"] in ("wandb", "none")
    if name == "wandb":
        # Offline unless asked (logger.mode or WANDB_MODE): a run must never need a network or a login.
        assert config["logger"]["mode"] is None


def _validate_jobs(name: str, figure: str, sweep_dir: str, preset: list[str], every: bool) -> None:
    """The figure's sweep file loads, and each job of the figure (or its first and last)
    composes and validates as the multirun will run it."""
    spec = load_sweep(find_sweep_file(figure))
    assert spec.name == name and sweep_dir.endswith(f"figures/{name}")
    jobs = figure_jobs(spec)
    for job in jobs if every else jobs[:1] + jobs[1:][-1:]:
        validate(composed([*preset, *job.overrides]))


def _composed_preset(name: str) -> tuple[str, str, list[str]]:
    """An experiment is a Hydra preset over the sweeper: composed by Hydra, its figure, its
    sweep directory, and what its jobs compose with (nothing where it sets nothing outside
    Hydra's settings: then tests/composing.py composes each job's groups once for all figures)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("FigureSweeper")
    figure, sweep_dir = cfg.hydra.sweeper.figure, cfg.hydra.sweep.dir
    with open_dict(cfg):
        del cfg["hydra"]
    return figure, sweep_dir, [] if OmegaConf.to_container(cfg, resolve=True) == composed([]) else [f"+experiment={name}"]


def _preset_file(name: str) -> tuple[str, str, list[str]]:
    """What _composed_preset finds, read from the preset's file (Hydra's composition costs 0.3 s
    a preset: the quick tier composes one, test_an_experiment_preset_s_file_is_what_hydra_composes)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml"))
    assert {"override /hydra/sweeper": "figure"} in raw["defaults"], raw["defaults"]
    figure, sweep_dir = raw["hydra"]["sweeper"]["figure"], raw["hydra"]["sweep"]["dir"]
    return figure, sweep_dir, [] if set(raw) == {"defaults", "hydra"} else [f"+experiment={name}"]


def test_an_experiment_preset_s_file_is_what_hydra_composes() -> None:
    name = options("experiment")[0]
    figure, sweep_dir, preset = _composed_preset(name)
    read = _preset_file(name)
    assert (figure, preset) == (read[0], read[2]) and sweep_dir == read[1].replace("${run.out_root}", "outputs")


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_preset_composes_a_figure_and_its_first_and_last_jobs(name: str) -> None:
    _validate_jobs(name, *_preset_file(name), every=False)


@pytest.mark.slow  # long, not a process: every job of every figure, each preset composed by Hydra
@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_preset_composes_a_figure_and_its_jobs(name: str) -> None:
    _validate_jobs(name, *_composed_preset(name), every=True)


def test_every_figure_has_an_experiment_preset() -> None:
    figures = sorted(load_sweep(path).name for path in (CONF.parent / "sweeps").glob("*.yaml"))
    assert figures == options("experiment")


COMPOSING = [
    [],
    ["model=gpt", "model.layers=4", "strategy=megatron", "strategy.tp=1", "backend=torch", "cluster=local", "logger=none"],
    ["strategy=par4d", "strategy.grid=[2,2,1,1]", "model=unet", "model.channel_mult=[1,2]", "~model.preset"],
    ["+experiment=par4d_fig3_overlaps", "model.scale=tiny"],
    ["train.global_batch=8", "cluster.nodes=2"],
    ["logger=none", "cluster=a800", "strategy=disttrain", "model=mllm_9b", "backend=torch", "strategy.llm.tp=2"],
    ["model=gpt", "model=unet", "strategy=par4d"],
]


@pytest.mark.parametrize("overrides", COMPOSING, ids=lambda o: " ".join(o) or "defaults")
def test_the_tests_composing_is_hydra_s(overrides: list[str]) -> None:
    """tests/composing.py's shortcut (group choices composed once, value overrides applied to
    a copy) gives what Hydra's full composition gives, twice in a row (the cache stays intact)."""
    assert composed(overrides) == composed(overrides) == hydra_composed(overrides)


@pytest.mark.parametrize("bad", [["model.layer=4"], ["model=gpt", "strategy.tp=[1"]])
def test_the_tests_composing_refuses_what_hydra_refuses(bad: list[str]) -> None:
    with pytest.raises(Exception) as hydra_refusal:
        hydra_composed(bad)
    with pytest.raises(type(hydra_refusal.value), match=re.escape(str(hydra_refusal.value))):
        composed(bad)


def test_default_config_is_clip_megatron_on_p3() -> None:
    config = compose_config()
    assert (config["model"]["name"], config["strategy"]["name"], config["cluster"]["name"], config["backend"]["name"]) == (
        "clip",
        "megatron",
        "p3_16xlarge",
        "sim",
    )


# --------------------------------------------------------------------------- (model, cluster) pairs

PAIRS = [(m, c) for m in options("model") for c in options("cluster")]


def pair_config(model: str, cluster: str) -> dict[str, Any]:
    """The config of `model=<model> cluster=<cluster>`: groups compose independently, so
    the model's composition with the cluster's group swapped in (composing all pairs costs
    0.2 s each; test_pair_config_equals_composition checks the shortcut)."""
    config = compose_config(f"model={model}")
    config["cluster"] = compose_config(f"cluster={cluster}")["cluster"]
    config["run"]["name"] = f"{config['model']['name']}-{config['strategy']['name']}-{config['cluster']['name']}"
    return config


@pytest.mark.parametrize("model,cluster", [("gpt", "perlmutter"), ("mllm_72b", "hopper"), ("clip", "local")])
def test_pair_config_equals_composition(model: str, cluster: str) -> None:
    assert pair_config(model, cluster) == compose_config(f"model={model}", f"cluster={cluster}")


@pytest.mark.parametrize("model,cluster", PAIRS, ids=[f"{m}-{c}" for m, c in PAIRS])
def test_train_spec_builds_for_every_model_and_cluster(model: str, cluster: str) -> None:
    config = pair_config(model, cluster)
    spec = cluster_from_config(config["cluster"])
    model_spec = build_model(config["model"], config["train"]["seq_len"])
    train = train_from_config(config["train"], spec, model_spec.default_global_batch)
    assert isinstance(train, TrainSpec)
    assert train.precision == spec.default_precision  # precision: auto
    assert train.global_batch == model_spec.default_global_batch  # global_batch: null
    assert train.steps > 0 and 0 < train.contrastive_batch <= train.global_batch


def test_the_data_is_the_workloads_with_the_models_default() -> None:
    assert validate(compose_config("model=mllm_9b", "strategy=megatron")).train.data == "interleaved"
    assert validate(compose_config("model=mllm_9b", "train.data=uniform")).train.data == "uniform"
    assert validate(compose_config("model=clip")).train.data == "uniform"
    with pytest.raises(ConfigError, match=r"train.data='interleaved': this model's samples hold uniform data"):
        validate(compose_config("model=clip", "train.data=interleaved"))


# --------------------------------------------------------------------------- cluster yaml files


def _raw_cluster(name: str) -> dict[str, Any]:
    # Read as Hydra reads it: OmegaConf's YAML loader takes `15.7e12` as a float, where
    # PyYAML's YAML 1.1 resolver would leave it a string.
    return OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / f"{name}.yaml"))


@pytest.mark.parametrize("name", options("cluster"))
def test_every_constant_of_a_preset_has_a_source(name: str) -> None:
    raw = _raw_cluster(name)
    assert not unsourced(raw), f"conf/cluster/{name}.yaml gives no source for {unsourced(raw)}"
    assert all(str(v).strip() for v in raw["sources"].values())


@pytest.mark.parametrize("name", options("cluster"))
def test_cluster_yaml_states_every_field(name: str) -> None:
    raw = _raw_cluster(name)
    # A preset with a host profile states whose CPU model's it takes (profile_cpu).
    extra = CLUSTER_EXTRA_FIELDS + (("profile_cpu",) if raw.get("profile") is not None else ())
    missing = [f for f in CLUSTER_SPEC_FIELDS + extra if f not in raw]
    assert not missing, f"conf/cluster/{name}.yaml does not state {missing}"
    unknown = sorted(set(raw) - set(CLUSTER_SPEC_FIELDS) - set(extra))
    assert not unknown, f"conf/cluster/{name}.yaml has keys nothing reads (typo?): {unknown}"
    nulls = [f for f in CLUSTER_SPEC_FIELDS if raw[f] is None]
    assert not nulls, f"conf/cluster/{name}.yaml leaves {nulls} null"
    assert raw["name"] == name
    assert isinstance(raw["device"], str) and raw["device"].strip()
    assert isinstance(raw["sources"], dict) and raw["sources"]


def test_a_cluster_refuses_an_unknown_host_launch_and_graphs_on_cpu_workers() -> None:
    cfg = _raw_cluster("hopper")
    with pytest.raises(ConfigError, match=r"host_launch must be one of \['eager', 'graphed'\], got 'graph'"):
        cluster_from_config({**cfg, "host_launch": "graph"})
    with pytest.raises(ConfigError, match="cluster hopper has no host_launch: every preset must state it"):
        cluster_from_config({k: v for k, v in cfg.items() if k != "host_launch"})
    local = _raw_cluster("local")
    with pytest.raises(ConfigError, match="host_launch=graphed replays CUDA graphs"):
        cluster_from_config({**local, "host_launch": "graphed"})


@pytest.mark.parametrize("name", options("cluster"))
def test_cluster_yaml_numbers_are_positive(name: str) -> None:
    raw = _raw_cluster(name)
    for key in ("nodes", "devices_per_node"):
        assert isinstance(raw[key], int) and not isinstance(raw[key], bool) and raw[key] > 0, (key, raw[key])
    peaks = raw["peak_flops"]
    assert isinstance(peaks, dict) and peaks
    for precision, value in peaks.items():
        assert isinstance(value, (int, float)) and value > 0, (precision, value)
    assert raw["default_precision"] in peaks
    for key in BANDWIDTHS:
        assert isinstance(raw[key], (int, float)) and raw[key] > 0, (key, raw[key])
    for key in FLOAT_FIELDS:
        assert isinstance(raw[key], (int, float)) and not isinstance(raw[key], bool), (key, raw[key])
        assert raw[key] >= 0, (key, raw[key])
    for key in ("gemm_max_efficiency", "memory_efficiency", "copy_efficiency", "intra_efficiency", "inter_efficiency"):
        assert 0 < raw[key] <= 1, (key, raw[key])
    assert 0 <= raw["reserved_memory_gib"] < raw["memory_gib"]
    if raw["devices"] is not None:
        assert raw["devices"] == raw["nodes"] * raw["devices_per_node"]


@pytest.mark.parametrize(
    "args, problem",
    [
        (["-m", "model=clip,clipp"], "In 'config': Could not find 'model/clipp'; choose one of clip, coca, gpt"),
        (["+experiment=nope"], "In 'config': Could not find 'experiment/nope'; choose one of distmm_fig10_placement"),
        (["model=gpt", "model.layers=2", "cluster=local", "hydra/launcher=joblib", "strategy=null"], None),
        (["model=choice(clip,coca)"], None),
        (["hydra.searchpath=[file://{mine}]", "-m", "strategy=toy,megatron"], None),
        (["hydra.searchpath=[file://{mine}]", "strategy=toi"], "In 'config': Could not find 'strategy/toi'; choose one of auto"),
        (["hydra.searchpath=[pkg://theirs.conf]", "strategy=toi"], None),
    ],
)
def test_an_option_its_group_lacks_is_named_before_hydra_sees_it(args: list[str], problem: str | None, tmp_path: Path) -> None:
    """The doors' check of group options (src.config.unknown_option): a multirun's too, which
    Hydra would answer in several lines and exit 1; keys, Hydra's own groups and sweep
    functions are Hydra's to judge, and a user's own config directory (hydra.searchpath)
    adds its options."""
    from src.config import unknown_option

    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "toy.yaml").write_text("name: toy\n")
    found = unknown_option([arg.replace("{mine}", str(tmp_path)) for arg in args])
    assert found == problem if problem is None else (found or "").startswith(problem)
