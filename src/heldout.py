"""The simulator against public runs it was never tuned to (a check, never an input).

    python -m src.heldout [--runs benchmarks/heldout/runs.yaml] [--out benchmarks/results] [--only k22]

Each training run of the data file (Megatron-LM's and ZeRO-3's published runs on DGX A100
clusters, small GPTs on one 8 x A100 node, ...) is planned with the configuration its source
states on the preset the source ran on (a source's `common`: its preset, model settings and
precision; nodes = GPUs / the preset's devices per node) and simulated; the published
iteration time is the source's, or, where the source gives achieved teraFLOP/s per GPU, its
own FLOP count (Narayanan et al. 2021, Eq. 3) over that rate, or, where it gives tokens per
second, the batch's tokens over that rate. Each collective of the file (a library's time on
a machine, from runs its preset's measured tables did not take) is priced by the preset's
communication model over that many consecutive ranks; each GEMM (a library's rate at one shape
on one device, from campaigns the presets' GEMM curves and tables did not take) by the
preset's compute model. Writes heldout.json and heldout.md
under --out (with --only, a subset, only under an --out given): per run the published and
simulated seconds and the error (negative: the simulator is faster), per source, series and
preset the mean absolute error and how many runs fall on each side, and, per series of
collectives, the error at the points the preset's own tables measured too (another campaign:
there the simulator returns that measurement, so the error is the campaigns' difference). No
constant is set from these numbers: a gap is reported with what we believe causes it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError
from src.out_paths import output_dir

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "benchmarks" / "heldout" / "runs.yaml"
OUT = REPO / "benchmarks" / "results"
DEFAULT_CLUSTER = "dgx_a100"


@dataclass(frozen=True)
class Run:
    id: str
    source: str
    where: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    global_batch: int
    strategy: dict[str, Any]
    published: dict[str, float]
    config: str = ""
    assumed: str = ""
    seq_len: int | None = None  # the run's own sequence length where its source's varies

    def seq(self, common: dict[str, Any]) -> int:
        return int(self.seq_len or common["model"]["seq_len"])


@dataclass(frozen=True)
class CollectiveRun:
    """A collective a source timed on a machine: `op` over `ranks` consecutive ranks (whole
    nodes of `cluster`) on a buffer of `mib` MiB (an all-gather's output, a reduce-scatter's
    input), `published_ms` milliseconds."""

    id: str
    source: str
    where: str
    cluster: str
    op: str
    ranks: int
    mib: float
    published_ms: float
    assumed: str = ""


@dataclass(frozen=True)
class GemmRun:
    """A GEMM a source timed on one device of `cluster`: C[m, n] = A[m, k] @ B[k, n] at
    `precision`, `published_tflops` TFLOP/s (2bmnk over the time); `b` > 1: that many GEMMs of
    the shape in one batched kernel."""

    id: str
    source: str
    where: str
    cluster: str
    precision: str
    m: int
    n: int
    k: int
    published_tflops: float
    assumed: str = ""
    b: int = 1


@dataclass(frozen=True)
class KernelRun:
    """A memory-bound operation's pass a source timed alone on one device of `cluster` (with
    its source's `cluster_settings`): `op` "layernorm" (PyTorch's LayerNorm, one kernel each
    way), "rmsnorm" (Transformers' LlamaRMSNorm, step by step as src/models/elementwise.py
    prices it) or "cross_entropy" (PyTorch's, as src/models/cross_entropy.py's eager mode
    prices it) over `rows` x `width` values of `dtype_bytes` bytes; `phase` "fwd", "bwd" (the
    input's gradient, and a norm's scale's), or "full" (the one, then the other);
    `published_ms` its time."""

    id: str
    source: str
    where: str
    cluster: str
    op: str
    phase: str
    rows: int
    width: int
    dtype_bytes: int
    published_ms: float
    assumed: str = ""


# A source's model settings (its `common.model`): the software's, each stated, then the
# architecture where its models are not GPT-3's (passed on only where stated), for a
# Llama's blocks which of their operations the software runs unfused (stated: it moves a
# Llama block's time by several per cent), and the copies its attention makes where its
# source was read for them (passed on only where stated).
SOFTWARE = ("vocab", "seq_len", "attention", "param_grad_kernels", "cross_entropy", "grad_accumulation", "dropout")
ARCHITECTURE = ("style", "ffn", "kv_heads")
LLAMA_SOFTWARE = ("unfused",)
READ_WHERE_STATED = ("attention_copies",)
MODEL_SETTINGS = frozenset(SOFTWARE + ARCHITECTURE + LLAMA_SOFTWARE + READ_WHERE_STATED)
# The memory-bound operations a held-out kernel may time: PyTorch's LayerNorm, Transformers'
# RMSNorm run step by step, PyTorch's cross entropy (log_softmax then nll_loss).
KERNEL_OPS = ("layernorm", "rmsnorm", "cross_entropy")
PHASES = ("fwd", "bwd", "full")  # a held-out kernel's passes: forward, backward, or one after the other


def load(path: Path) -> tuple[dict[str, Any], list[Run]]:
    """The data file's sources and common settings, and its training runs."""
    data = yaml.safe_load(path.read_text())
    runs = typed_rows(Run, data["runs"], "run")
    cited = {r.source for r in runs} | {c["source"] for key in ("collectives", "gemms", "kernels") for c in data.get(key) or []}
    unknown = sorted(cited - set(data["sources"]))
    if unknown:
        raise ConfigError(f"{path}: runs cite sources {unknown} that `sources` does not list")
    # Each row with its kind's keys; a kernel's op one the model prices.
    collective_runs(data), gemm_runs(data), kernel_runs(data)
    stated = {"the file": data["common"]} | {name: source.get("common") or {} for name, source in data["sources"].items()}
    for name, common in stated.items():
        if "model" not in common:
            continue  # the file's settings hold
        # A source's model settings replace the file's whole: each software setting stated, and
        # none that no run reads (a misspelt one would be dropped without a word).
        model = set(common["model"])
        required = SOFTWARE + (LLAMA_SOFTWARE if common["model"].get("style") == "llama" else ())
        missing, unread = sorted(set(required) - model), sorted(model - MODEL_SETTINGS)
        if missing:
            raise ConfigError(f"{path}: {name}'s model settings lack {missing}")
        if unread:
            raise ConfigError(f"{path}: {name}'s model settings {unread} are not ones a run reads: {sorted(MODEL_SETTINGS)}")
    for run in runs:  # its overrides (its GPUs on its preset's nodes), refused before any run is priced
        overrides(run, settings(run, data))
    return data, runs


def typed_rows(cls: type[Any], rows: list[dict[str, Any]], kind: str) -> list[Any]:
    """The data file's rows of one kind as `cls`, each with that kind's keys, or one line
    naming the row and the keys it lacks or that no such row has."""
    known = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    for row in rows:
        unknown, missing = sorted(set(row) - known), sorted(required - set(row))
        if unknown or missing:
            keys = f"unknown keys {unknown}, missing keys {missing}"
            raise ConfigError(f"{kind} {row.get('id', '?')!r}: {keys}; a {kind} has {sorted(known)}")
    return [cls(**row) for row in rows]


def collective_runs(data: dict[str, Any]) -> list[CollectiveRun]:
    return typed_rows(CollectiveRun, data.get("collectives") or [], "collective")


def gemm_runs(data: dict[str, Any]) -> list[GemmRun]:
    return typed_rows(GemmRun, data.get("gemms") or [], "gemm")


def kernel_runs(data: dict[str, Any]) -> list[KernelRun]:
    runs = typed_rows(KernelRun, data.get("kernels") or [], "kernel")
    for run in runs:
        if run.op not in KERNEL_OPS or run.phase not in PHASES:
            known = f"ops are {list(KERNEL_OPS)}, phases {list(PHASES)}"
            raise ConfigError(f"kernel {run.id}: op {run.op!r}, phase {run.phase!r}; {known}")
    return runs


def settings(run: Run, data: dict[str, Any]) -> dict[str, Any]:
    """The model settings, precision and preset of the run's source (the file's `common`
    where the source states none of its own)."""
    return {**data["common"], **(data["sources"][run.source].get("common") or {})}


def narayanan_flops(run: Run, seq_len: int, vocab: int) -> float:
    """FLOPs of one iteration as Narayanan et al. 2021 count them (Eq. 3, with the
    recomputed forward): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    b, s, l, h = run.global_batch, seq_len, run.layers, run.hidden
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + vocab / (16.0 * l * h))


def megatron_core_flops(run: Run, seq_len: int, vocab: int) -> float:
    """FLOPs of one iteration as Megatron-LM's num_floating_point_operations counts them
    for a GPT (4h MLP, every head its own keys and values, no recomputation):
    72 B s l h^2 (1 + s/6h + V/12lh)."""
    b, s, l, h = run.global_batch, seq_len, run.layers, run.hidden
    return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + vocab / (12.0 * l * h))


# How a source counts the FLOPs behind the teraFLOP/s it reports (its `flops`).
FLOP_COUNTS = {"narayanan2021": narayanan_flops, "megatron_core": megatron_core_flops}


def published_seconds(run: Run, seq_len: int, vocab: int, flops: str = "narayanan2021") -> float:
    if "iteration_s" in run.published:
        return float(run.published["iteration_s"])
    if "tflops_per_gpu" in run.published:
        if flops not in FLOP_COUNTS:
            raise ConfigError(f"run {run.id}: its source counts FLOPs as {flops!r}; known: {sorted(FLOP_COUNTS)}")
        return FLOP_COUNTS[flops](run, seq_len, vocab) / (run.published["tflops_per_gpu"] * 1e12 * run.gpus)
    if "tokens_per_s" in run.published:
        return run.global_batch * seq_len / float(run.published["tokens_per_s"])
    if "tokens_per_gpu_s" in run.published:
        return run.global_batch * seq_len / (float(run.published["tokens_per_gpu_s"]) * run.gpus)
    raise ConfigError(
        f"run {run.id}: published needs iteration_s, tflops_per_gpu, tokens_per_s or tokens_per_gpu_s, got {sorted(run.published)}"
    )


def _devices_per_node(cluster: str) -> int:
    from src.cluster_profile import preset_file

    preset = preset_file(cluster)
    if preset is None:
        raise ConfigError(f"no cluster preset {cluster!r} (conf/cluster/{cluster}.yaml)")
    return int(preset["devices_per_node"])


def overrides(run: Run, common: dict[str, Any]) -> list[str]:
    """The front door's overrides for the run's stated configuration."""
    cluster = str(common.get("cluster", DEFAULT_CLUSTER))
    per_node = _devices_per_node(cluster)
    # A run on part of one node (a single GPU, a model-parallel group) takes that many of its devices.
    part = run.gpus < per_node and per_node % run.gpus == 0
    if run.gpus % per_node and not part:
        raise ConfigError(f"run {run.id}: {run.gpus} GPUs is neither whole {per_node}-GPU {cluster} nodes nor a part of one")
    model = common["model"]
    out = ["model=gpt", "model.preset=null", f"model.layers={run.layers}", f"model.hidden={run.hidden}", f"model.heads={run.heads}"]
    # The software's settings (the sequence is the run's own: train.seq_len below), then the
    # architecture where the source's models are not GPT-3's (a Llama's RMSNorm, SwiGLU MLP of
    # its own width, grouped-query attention), and the attention's copies where stated.
    out += [f"model.{key}={_value(model[key])}" for key in SOFTWARE if key != "seq_len"]
    out += [f"model.{key}={_value(model[key])}" for key in ARCHITECTURE + LLAMA_SOFTWARE + READ_WHERE_STATED if key in model]
    out += [
        f"train.seq_len={run.seq(common)}",
        f"train.global_batch={run.global_batch}",
        f"train.precision={common['precision']}",
        f"cluster={cluster}",
        *(["cluster.nodes=1", f"cluster.devices_per_node={run.gpus}"] if part else [f"cluster.nodes={run.gpus // per_node}"]),
        f"cluster.amp={_value(bool(common.get('amp', False)))}",
        "logger=none",
    ]
    # What the source's machine has that its preset's does not (an A100's 40 GB and its HBM2).
    out += [f"cluster.{key}={_value(value)}" for key, value in (common.get("cluster_settings") or {}).items()]
    strategy = dict(run.strategy)
    name = strategy.pop("name")
    out.append(f"strategy={name}")
    # The source's settings of this strategy where the run states none (the data file's
    # `common`), then the run's; what neither states, the planner searches.
    strategy = {**(common.get(name) or {}), **strategy}
    if name == "megatron" and "vpp" in strategy:
        strategy["schedule"] = "interleaved" if strategy["vpp"] > 1 else "1f1b"
    out += [f"strategy.{key}={_value(value)}" for key, value in strategy.items()]
    return out


def _value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def simulate_run(run: Run, common: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Seconds of one simulated iteration of the run's plan, and where they go (the parts of
    the summary's breakdown that are not zero, averaged over the ranks)."""
    from src.config import composed
    from src.setup import plan_run, validate
    from src.sim.engine import simulate

    setup = validate(composed(overrides(run, common)))
    plan = plan_run(setup)
    timeline = simulate(plan.program, setup.model, setup.cluster, plan.precision)
    return timeline.iteration_time, {kind: s for kind, s in timeline.mean_breakdown().items() if s > 0}


def command(run: Run, common: dict[str, Any]) -> str:
    """The front door's command that prices the run (its summary, trace and plan to read)."""
    return " ".join(["python -m src.run", *map(shlex.quote, overrides(run, common))])


def check(runs: list[Run], data: dict[str, Any], commands: bool = False) -> list[dict[str, Any]]:
    """Each run priced on its preset, its line printed as it goes (with `commands`, the front
    door's command that prices it under it)."""
    rows = []
    for run in runs:
        common = settings(run, data)
        row: dict[str, Any] = {
            "id": run.id,
            "source": run.source,
            "where": run.where,
            "series": series(run),
            "preset": str(common.get("cluster", DEFAULT_CLUSTER)),
            "gpus": run.gpus,
            "assumed": run.assumed,
        }
        published = published_seconds(run, run.seq(common), common["model"]["vocab"], common.get("flops", "narayanan2021"))
        row["published_s"] = published
        try:
            simulated, parts = simulate_run(run, common)
        except (ConfigError, RuntimeError) as err:
            row["error"] = str(err).splitlines()[0]
        else:
            row.update(simulated_s=simulated, error_pct=100.0 * (simulated - published) / published, breakdown_s=parts)
        row["command"] = command(run, common)
        rows.append(row)
        shown = row.get("error") or (
            f"published {published:.3f} s, simulated {row['simulated_s']:.3f} s ({row['error_pct']:+.1f} %): "
            + ", ".join(f"{kind} {s:.3g} s" for kind, s in row["breakdown_s"].items())
        )
        print(f"{run.id}: {shown}", file=sys.stderr, flush=True)
        if commands:
            print(f"  {row['command']}", file=sys.stderr, flush=True)
    return rows


def collective_seconds(run: CollectiveRun) -> float:
    """Seconds of the collective on its preset, over that many consecutive ranks."""
    from dataclasses import replace

    from src.cluster import MIB
    from src.costmodel.comm import CommModel

    from src.setup import preset_cluster

    per_node = _devices_per_node(run.cluster)
    if run.ranks % per_node:
        raise ConfigError(f"collective {run.id}: {run.ranks} ranks is not a whole number of {per_node}-device {run.cluster} nodes")
    cluster = replace(preset_cluster(run.cluster), nodes=run.ranks // per_node)
    return CommModel(cluster).collective_time(run.op, tuple(range(run.ranks)), run.mib * MIB)


def preset_measured_seconds(run: CollectiveRun) -> float | None:
    """The time the preset's own measured tables give at exactly this collective, group and
    buffer (another campaign of the same library on the machine), None where they have no
    such point: there the simulator returns that measurement, so its error is the two
    campaigns' difference, which no model of one campaign can close."""
    from src.cluster import MIB
    from src.setup import preset_cluster

    nbytes = run.mib * MIB
    for measured in preset_cluster(run.cluster).collective_measurements:
        table = measured.collectives.get(run.op)
        if table is not None and run.ranks in table.groups and nbytes in table.sizes:
            return table.seconds[table.groups.index(run.ranks)][table.sizes.index(nbytes)]
    return None


def check_collectives(runs: list[CollectiveRun]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        published = run.published_ms / 1e3
        simulated = collective_seconds(run)
        measured = preset_measured_seconds(run)
        rows.append(
            {
                "id": run.id,
                "source": run.source,
                "where": run.where,
                "series": f"{run.source}, {run.cluster} {run.op}",
                "preset": run.cluster,
                "gpus": run.ranks,
                "assumed": run.assumed,
                "published_s": published,
                "simulated_s": simulated,
                "error_pct": 100.0 * (simulated - published) / published,
                **({} if measured is None else {"preset_measured_s": measured}),
            }
        )
    return rows


def check_gemms(runs: list[GemmRun], kernel_timed: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Each GEMM priced by its preset's compute model on one device; for a source in
    `kernel_timed` (a profiler's kernel duration, `gemm_timing: kernel`) without the gap the
    model charges between kernels, which no kernel's duration holds."""
    from src.costmodel.compute import ComputeModel
    from src.setup import preset_cluster

    rows = []
    for run in runs:
        published = 2.0 * run.b * run.m * run.n * run.k / (run.published_tflops * 1e12)
        model = ComputeModel(preset_cluster(run.cluster), run.precision)
        simulated = (model.gemm_duration if run.source in kernel_timed else model.gemm_time)(run.m, run.n, run.k, run.b)
        series = f"{run.source}, {run.cluster} {'batched GEMMs' if run.b > 1 else 'GEMM'}"
        rows.append(_one_device_row(run, series, "gemm", published, simulated))
    return rows


def _one_device_row(run: GemmRun | KernelRun, series: str, kind: str, published: float, simulated: float) -> dict[str, Any]:
    """A row of one kernel on one device, marked `kind` ("gemm", "kernel"): a preset's
    summary leaves such rows out."""
    return {
        "id": run.id,
        "source": run.source,
        "where": run.where,
        "series": series,
        "preset": run.cluster,
        "gpus": 1,
        kind: True,
        "assumed": run.assumed,
        "published_s": published,
        "simulated_s": simulated,
        "error_pct": 100.0 * (simulated - published) / published,
    }


def kernel_seconds(run: KernelRun, settings: dict[str, Any]) -> float:
    """The pass as the compute model prices the model's own kernel (a norm; Transformers'
    RMSNorm run step by step; the loss, PyTorch's cross entropy) over the run's values, on its
    preset with `settings`."""
    from dataclasses import replace

    from src.costmodel.compute import ComputeModel
    from src.mesh import Sharding
    from src.models.cross_entropy import eager_loss
    from src.models.elementwise import unfused_kernel
    from src.models.layers import ACT_BYTES, memory
    from src.setup import preset_cluster

    # A kernel of 16-bit values of `width` a row; wider values move as many more bytes.
    values = run.width * run.dtype_bytes / ACT_BYTES
    if run.op == "cross_entropy":
        kernel = eager_loss(values, round(values))
    elif run.op == "rmsnorm":
        kernel = unfused_kernel(memory(run.op, values, norm=run.width, op="rmsnorm"))
    else:
        kernel = memory(run.op, values, norm=run.width)
    times = ComputeModel(replace(preset_cluster(run.cluster), **settings), "bf16").kernel_times(kernel, run.rows, Sharding(), 1)
    backward = times.bwd_input + times.bwd_weight
    return {"fwd": times.fwd, "bwd": backward, "full": times.fwd + backward}[run.phase]


def check_kernels(runs: list[KernelRun], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each kernel priced on its preset with its source's `cluster_settings`."""
    rows = []
    for run in runs:
        published = run.published_ms / 1e3
        settings = (data["sources"][run.source].get("common") or {}).get("cluster_settings") or {}
        series = f"{run.source}, {run.cluster} {run.op} {run.phase}"
        rows.append(_one_device_row(run, series, "kernel", published, kernel_seconds(run, settings)))
    return rows


def campaigns(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per series of collectives: over the points the preset's own tables measured too, the
    simulator's mean absolute error and the tables' measurement's against the source (the
    same where the simulator returns the measurement)."""
    out = {}
    for group in dict.fromkeys(r["series"] for r in rows if "preset_measured_s" in r):
        on = [r for r in rows if r["series"] == group and "preset_measured_s" in r]
        out[group] = {
            "points": len(on),
            "of": sum(r["series"] == group for r in rows),
            "mape_pct": statistics.fmean(abs(r["error_pct"]) for r in on),
            "measurement_mape_pct": statistics.fmean(
                100 * abs(r["preset_measured_s"] - r["published_s"]) / r["published_s"] for r in on
            ),
        }
    return out


def series(run: Run) -> str:
    """The source, its table and the strategy: the groups whose errors are summed up."""
    table = run.where.split(" (")[0]
    strategy = run.strategy["name"] + (f" ZeRO-{run.strategy['zero_stage']}" if "zero_stage" in run.strategy else "")
    return f"{run.source}, {table}, {strategy}"


def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Per value of `key` (source, series): mean absolute error, mean signed error, runs
    simulated faster / slower."""
    out = {}
    for group in dict.fromkeys(r[key] for r in rows):
        errors = [r["error_pct"] for r in rows if r[key] == group and "error_pct" in r]
        if errors:
            out[group] = {
                "runs": len(errors),
                "mape_pct": statistics.fmean(abs(e) for e in errors),
                "mean_error_pct": statistics.fmean(errors),
                "simulated_faster": sum(e < 0 for e in errors),
                "simulated_slower": sum(e >= 0 for e in errors),
            }
    return out


def summaries_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per preset, source and series. A preset's figure is its training runs and
    collectives, whole systems; its GEMMs and memory-bound kernels, one operation each, count
    by source and series."""
    systems = [r for r in rows if not (r.get("gemm") or r.get("kernel"))]
    return {"preset": summarize(systems, "preset"), **{key: summarize(rows, key) for key in ("source", "series")}}


def table(
    rows: list[dict[str, Any]],
    summaries: dict[str, dict[str, dict[str, Any]]],
    data: dict[str, Any],
    repeats: dict[str, dict[str, Any]],
) -> str:
    lines = [
        "# Held-out public runs",
        "",
        "`python -m src.heldout`: each run priced with its source's configuration on the preset it ran on",
        "(benchmarks/heldout/runs.yaml); each collective by the preset's communication model, each GEMM by its compute model.",
        "Error = (simulated - published) / published: negative, the simulator is faster. A check: no constant is",
        "set from these numbers.",
        "",
        "| run | source | preset | GPUs | published s | simulated s | error % | assumed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        simulated = f"{r['simulated_s']:.4g}" if "simulated_s" in r else f"failed: {r['error']}"
        error = f"{r['error_pct']:+.1f}" if "error_pct" in r else ""
        cells = [r["id"], f"{r['source']} ({r['where']})", r["preset"], str(r["gpus"]), f"{r['published_s']:.4g}", simulated, error]
        lines.append("| " + " | ".join([*cells, r["assumed"]]) + " |")
    for key, summary in summaries.items():
        lines += ["", f"| {key} | runs | MAPE % | mean error % | simulated faster / slower |", "|---|---|---|---|---|"]
        for group, s in summary.items():
            lines.append(
                f"| {group} | {s['runs']} | {s['mape_pct']:.1f} | {s['mean_error_pct']:+.1f} | "
                f"{s['simulated_faster']} / {s['simulated_slower']} |"
            )
    if repeats:
        lines += [
            "",
            "Collectives at a point the preset's own measured tables hold too (the same library on that kind of machine,",
            "another campaign): the simulator returns that measurement there, so its error is the two campaigns'",
            "difference, which no model fitted to one campaign can close.",
            "",
            "| series | points measured by both | MAPE % there | the preset's measurement against the source, MAPE % |",
            "|---|---|---|---|",
        ]
        for group, c in repeats.items():
            lines.append(f"| {group} | {c['points']} of {c['of']} | {c['mape_pct']:.1f} | {c['measurement_mape_pct']:.1f} |")
    lines += ["", "Sources:"]
    lines += [f"- {key}: {s['title']}; {s['software']}" for key, s in data["sources"].items()]
    return "\n".join(lines)


def main() -> None:
    from src.cluster_inputs import priced_on

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--out", type=output_dir, help="where heldout.json and heldout.md go (default benchmarks/results)")
    parser.add_argument(
        "--only",
        default="",
        help="the runs whose id contains this: printed (a training run with the front door's command that prices it), "
        "written only under an --out given",
    )
    args = parser.parse_args()
    try:
        data, runs = load(args.runs)
    except (OSError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    runs = [r for r in runs if args.only in r.id]
    collectives = [c for c in collective_runs(data) if args.only in c.id]
    gemms = [g for g in gemm_runs(data) if args.only in g.id]
    kernels = [k for k in kernel_runs(data) if args.only in k.id]
    if not runs and not collectives and not gemms and not kernels:
        parser.error(f"--only {args.only!r} matches no run of {args.runs}")
    kernel_timed = frozenset(name for name, source in data["sources"].items() if source.get("gemm_timing") == "kernel")
    rows = check(runs, data, commands=bool(args.only)) + check_collectives(collectives)
    rows += check_gemms(gemms, kernel_timed) + check_kernels(kernels, data)
    summaries = summaries_of(rows)
    repeats = campaigns(rows)
    text = table(rows, summaries, data, repeats)
    # The presets every row was priced on, so that a later change of their constants shows the results stale.
    text += "\n\n" + priced_on([f"cluster={preset}"] for preset in sorted({row["preset"] for row in rows}))
    # A subset never lands on the full results by default: the scorecard cites rows of that file.
    out = args.out or (None if args.only else OUT)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "heldout.json").write_text(json.dumps({"rows": rows, "by": summaries, "campaigns": repeats}, indent=2) + "\n")
        (out / "heldout.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
