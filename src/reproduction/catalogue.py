"""The headline catalogue: one YAML file per paper (benchmarks/reproduction/<paper>.yaml) and
the declared ranges of the parameters papers leave unstated (ranges.yaml beside them).

A paper's file lists its figures and tables; each names the figure preset (sweeps/<preset>.yaml)
whose results hold ours, and lists
- headlines: one number the paper states (a value, [low, high] or {up_to: X}), where it says
  it, its kind (verdict.KINDS) and where ours is: a group (a list of groups for "up to" and
  "as low as"), a series and a field of that preset's results ('value', the figure's metric,
  or one of its extra_metrics), optionally over another series' field in the same group
  (`over`, its field `over_field` if not the same; a list means the smallest of them, e.g. "the
  most memory-efficient baseline"); and why a miss misses (`miss`, see below);
- claims: qualitative statements (who wins, which way a trend goes, whether a value stays
  steady: every group within the rule's 10 % of the smallest), their check (verdict.CHECKS)
  and, like a headline, why a miss misses; a check with `per: <series>` reads every series'
  field over that series' in the same group (a speed-up over it, when the field is a time).
A figure's keys preset, series, field, kind and miss are its headlines' defaults.

`miss` is one explanation or a list of them, tried in order: {cause, evidence} and, for
`unstated`, the sensitivity sweeps (`sensitivity: [ids]`) over which the row is judged, for
`simulator`, the measurements where the simulator errs the same way (`measured: {name: {file,
row: {key: value}}}`) and what in them says so (`errs: [[a, b], ...]`, each a field of a
measurement, `measured.NAME:field`, or a number, and a below b: `[measured.small:error_pct, 0]`,
the simulator faster than measured). An `unstated` explanation explains a miss only when the
paper's value is within what its declared range gives; one with `when: above` (or `below`) only
where ours misses above (below) the paper's value, the side its measurement errs to; a
`simulator` one only where its measurements do err so (a re-measured file may not); otherwise
the next explanation does, else none.

An evidence text states no number of its own: every number comes from a placeholder, filled
when the scorecard is written and checked to resolve when the catalogue loads:
- `{series:field}`, `{series:field@group}`: the row's preset's results (`%` after the field
  shows a fraction as a percentage);
- `{measured.NAME:field}`: a field of the explanation's measurement (dotted for nesting);
- `{config.SERIES:key}`, `{config.SERIES:key@group}`: the value an override of that preset's job sets;
- `{paper.SERIES:field}`: the paper's value the preset's group states (`value`: of the figure's
  metric, in `paper`; another field, in `paper_extra`), `%` after it as above;
- `{ours}`, `{at}`: the row's own value and, for "up to" or "as low as", the group it is at.

`sensitivity` entries name a preset sweeping one parameter (`range`, an id of ranges.yaml) and
the preset's groups are matched to a row's figure groups: a sensitivity group matches a figure
group when every job of the row's series is the figure's but for the parameter (under any of
the range's keys, one value for every series); each figure group must find one match per value
of the range.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError
from src.reproduction.verdict import CAUSES, CHECKS, KINDS, NOT_EXPLAINED, PaperValue
from src.sweep import REPO, SweepSpec, figure_jobs, load_sweep, lookup

CATALOGUE_DIR = REPO / "benchmarks" / "reproduction"
SWEEPS_DIR = REPO / "sweeps"
RANGES_FILE = "ranges.yaml"

# {source:field} or {source:field@group}; source a series, measured.NAME or config.SERIES
PLACEHOLDER = re.compile(r"\{([^{}:@]+):([^{}@]+)(?:@([^{}]+))?\}")
ROW_PLACEHOLDER = re.compile(r"\{(ours|at)\}")
# A degree of a row's plan: plan.<unit>.<degree> (tp, pp, dp, micro_batch, ...)
PLAN_FIELD = re.compile(r"plan\.[a-z_0-9]+\.[a-z_]+")
# A number standing alone in a text (not a part of a name such as MLLM-72B, A800 or Llama3), and
# a reference to a part of the paper (Table 5, Fig. 5(c), §8.1, line 99) or a ZeRO stage, whose number is a name too.
TYPED_NUMBER = re.compile(r"(?<![A-Za-z0-9.])\d+(?:[.,]\d+)*(?:[eE][+-]?\d+)?(?![A-Za-z0-9])")
REFERENCE = re.compile(r"(?:\b(?:Tables?|Figures?|Figs?\.|lines?|Appendix)\s+|§)\d+(?:\.\d+)*(?:\([a-z]\))?(?:[-–]\d+)?|\bZeRO-\d\b")


def papers_in(directory: Path = CATALOGUE_DIR) -> list[str]:
    """The papers a catalogue directory holds, one <paper>.yaml each (ranges.yaml is none)."""
    return sorted(path.stem for path in directory.glob("*.yaml") if path.name != RANGES_FILE)


def typed_numbers(text: str) -> list[str]:
    """The numbers a text states outside its placeholders."""
    bare = REFERENCE.sub(" ", ROW_PLACEHOLDER.sub(" ", PLACEHOLDER.sub(" ", text)))
    return TYPED_NUMBER.findall(bare)


@dataclass(frozen=True)
class Locus:
    """Where ours is: a field of a preset's rows (over another series' field, if `over`)."""

    preset: str
    groups: tuple[str, ...]
    series: str
    field: str
    over: tuple[str, ...] = ()
    over_field: str = ""  # the `over` series' field; "" = the same field

    @property
    def series_used(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.series, *self.over)))

    def at(self, preset: str, group: str) -> Locus:
        """The same quantity at one group of (another) preset."""
        return Locus(preset, (group,), self.series, self.field, self.over, self.over_field)


@dataclass(frozen=True)
class Range:
    """A parameter a paper leaves unstated, the values it plausibly takes and their source."""

    id: str
    parameter: str  # what it is, in words
    keys: tuple[str, ...]  # the Hydra keys the sensitivity presets set it by, one per strategy's spelling
    values: tuple[str, ...]
    source: str  # why these values: a public convention, another paper, the paper's own hints

    def text(self) -> str:
        return f"{self.parameter} over {', '.join(self.values)} ({self.source})"


@dataclass(frozen=True)
class Measurement:
    """A measurement (held-out, validation, calibration) where the simulator errs the same
    way: the row of the file's `rows` with these keys, or the entry at a dotted path."""

    file: str
    row: dict[str, Any] = field(default_factory=dict)
    at: str = ""


# A term of a simulator cause's `errs`: a number, or (measurement name, field) of its measurements.
ErrsTerm = float | tuple[str, str]


@dataclass(frozen=True)
class Explanation:
    cause: str
    evidence: str
    sensitivity: tuple[str, ...] = ()  # unstated: the sensitivity sweeps' ids
    measured: dict[str, Measurement] = field(default_factory=dict)  # simulator: name -> measurement
    when: str = ""  # "above" / "below": it explains a headline only where ours misses on that side of the paper's value
    errs: tuple[tuple[ErrsTerm, ErrsTerm], ...] = ()  # simulator: (a, b) pairs its measurements show a < b for


@dataclass(frozen=True)
class Headline:
    id: str
    paper: str
    figure: str
    quantity: str
    value: PaperValue
    kind: str
    where: str
    locus: Locus
    quote: str = ""
    miss: tuple[Explanation, ...] = ()


@dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    figure: str
    claim: str
    where: str
    preset: str
    field: str
    check: dict[str, Any]
    miss: tuple[Explanation, ...] = ()


Setting = dict[str, tuple[str, str]]  # series -> (preset, group) where its value at one setting is read


@dataclass(frozen=True)
class RowMatch:
    """Where a row's series are at each value of a range: `settings[figure group]`, in the
    range's order. Where the sensitivity preset reports the figure's metric otherwise than the
    figure does (another metric, another normalisation), the figure's 'value' is built from
    the metric as each preset reports it (`raw[preset]`, a field), normalised as the figure is."""

    settings: dict[str, tuple[Setting, ...]]
    raw: dict[str, str] = field(default_factory=dict)  # empty: both presets' 'value' is the same quantity
    normalize: dict[str, Any] | None = None


@dataclass(frozen=True)
class Sensitivity:
    """A preset sweeping one ranged parameter, matched to the rows that name it."""

    id: str
    range: Range
    preset: str
    matches: dict[str, RowMatch]


@dataclass(frozen=True)
class Catalogue:
    paper: str
    title: str
    text: str  # the file name of the paper's text (kept outside the repository: reproduce --papers)
    headlines: tuple[Headline, ...]
    claims: tuple[Claim, ...]
    sensitivities: dict[str, Sensitivity]
    measurements: dict[str, Any]  # file -> its loaded JSON

    def presets(self) -> list[str]:
        names = [h.locus.preset for h in self.headlines] + [c.preset for c in self.claims]
        names += [s.preset for s in self.sensitivities.values()]
        return list(dict.fromkeys(names))


class Presets:
    """Sweep files by preset name, loaded once."""

    def __init__(self, directory: Path = SWEEPS_DIR) -> None:
        self.directory = directory
        self._specs: dict[str, SweepSpec] = {}

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.yaml"

    def __getitem__(self, name: str) -> SweepSpec:
        if name not in self._specs:
            path = self.path(name)
            if not path.is_file():
                raise ConfigError(f"no preset {name!r}: {path} does not exist")
            self._specs[name] = load_sweep(path)
        return self._specs[name]


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path.name} is not valid YAML: {str(err).splitlines()[0]}") from err


def load_ranges(directory: Path = CATALOGUE_DIR) -> dict[str, Range]:
    """The declared ranges (ranges.yaml), by id; none where the file is absent."""
    path = directory / RANGES_FILE
    if not path.is_file():
        return {}
    raw = _read_yaml(path) or {}
    ranges: dict[str, Range] = {}
    for entry in raw.get("ranges") or []:
        where = f"{RANGES_FILE}, range {entry.get('id', '?')!r}"
        _require(entry, ("id", "parameter", "override", "values", "source"), where)
        values = entry["values"]
        if not isinstance(values, list) or len(values) < 2:
            raise ConfigError(f"{where}: values must list at least two settings, is {values!r}")
        texts = tuple(str(v) for v in values)
        if len(set(texts)) != len(texts):
            raise ConfigError(f"{where}: values {list(texts)} repeat a setting")
        if not str(entry["source"]).strip():
            raise ConfigError(f"{where}: a range needs its source (a public convention, another paper, the paper's hints)")
        if entry["id"] in ranges:
            raise ConfigError(f"{where}: id appears more than once")
        keys = entry["override"] if isinstance(entry["override"], list) else [entry["override"]]
        if not keys or not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys):
            raise ConfigError(f"{where}: override must be a Hydra key or a list of distinct ones, is {entry['override']!r}")
        ranges[entry["id"]] = Range(entry["id"], entry["parameter"], tuple(keys), texts, str(entry["source"]).strip())
    return ranges


def load_catalogue(paper: str, presets: Presets, directory: Path = CATALOGUE_DIR, root: Path = REPO) -> Catalogue:
    """A paper's catalogue, every row checked to resolve to a preset, its groups, series and
    fields, every placeholder to resolve, every sensitivity to match its rows' figure groups.
    Measurement files are read relative to `root`."""
    path = directory / f"{paper}.yaml"
    if not path.is_file():
        raise ConfigError(f"no catalogue for {paper!r} ({path} does not exist)")
    raw = _read_yaml(path)
    where = path.name
    for key in ("paper", "title", "text", "figures"):
        if key not in raw:
            raise ConfigError(f"{where} lacks '{key}'")
    if raw["paper"] != paper:
        raise ConfigError(f"{where} says paper: {raw['paper']!r}, its file name {paper!r}")
    context = _Context(presets, load_ranges(directory), root, where)
    declared = {entry.get("id"): entry for entry in raw.get("sensitivity") or []}
    headlines: list[Headline] = []
    claims: list[Claim] = []
    for figure in raw["figures"]:
        defaults = {k: figure[k] for k in ("preset", "series", "field", "kind", "miss") if k in figure}
        for row in figure.get("headlines") or []:
            headlines.append(_headline({**defaults, **row}, paper, figure.get("figure", ""), context))
        claim_defaults = {k: v for k, v in defaults.items() if k != "miss"}  # a figure's miss speaks of its headlines
        for row in figure.get("claims") or []:
            claims.append(_claim({**claim_defaults, **row}, paper, figure.get("figure", ""), context))
    ids = [h.id for h in headlines] + [c.id for c in claims] + [str(i) for i in declared]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"{where}: ids {repeated} appear more than once")
    sensitivities = _sensitivities(declared, headlines, claims, context)
    return Catalogue(paper, raw["title"], raw["text"], tuple(headlines), tuple(claims), sensitivities, context.files)


@dataclass
class _Context:
    presets: Presets
    ranges: dict[str, Range]
    root: Path
    file: str
    files: dict[str, Any] = field(default_factory=dict)

    def preset(self, name: str, where: str) -> SweepSpec:
        try:
            return self.presets[name]
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err

    def measurement_file(self, name: str, where: str) -> Any:
        if name not in self.files:
            path = self.root / name
            if not path.is_file():
                raise ConfigError(f"{where}: measurement file {name} does not exist")
            try:
                self.files[name] = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: {name} is not JSON ({err.msg} at line {err.lineno})") from err
        return self.files[name]


def _require(row: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ConfigError(f"{where} lacks {missing}")


def _as_list(raw: Any) -> list[Any]:
    if raw is None:
        return []
    return list(raw) if isinstance(raw, list) else [raw]


def _locus(row: dict[str, Any], context: _Context, where: str, groups: list[str] | None = None) -> Locus:
    _require(row, ("preset", "series"), where)
    spec = context.preset(row["preset"], where)
    labels = [g["label"] for g in spec.groups]
    if groups is None:
        _require(row, ("group",), where)
        groups = _as_list(row["group"])
    over = _as_list(row.get("over"))
    field_name = row.get("field", "value")
    over_field = row.get("over_field", "")
    if over_field and not over:
        raise ConfigError(f"{where}: over_field {over_field!r} needs 'over' (the series it is read from)")
    for group in groups:
        if group not in labels:
            raise ConfigError(f"{where}: preset {spec.name} has no group {group!r} (its groups: {labels})")
    for series in [row["series"], *over]:
        if series not in spec.series:
            raise ConfigError(f"{where}: preset {spec.name} has no series {series!r} (its series: {sorted(spec.series)})")
        skipped = [g["label"] for g in spec.groups if g["label"] in groups and series in (g.get("skip") or [])]
        if skipped:
            raise ConfigError(f"{where}: preset {spec.name} does not run {series} in {skipped}")
    _check_field(spec, field_name, where)
    if over_field:
        _check_field(spec, over_field, where)
    return Locus(spec.name, tuple(groups), row["series"], field_name, tuple(over), over_field)


def _check_field(spec: SweepSpec, field_name: str, where: str) -> None:
    """A field every row of the preset's results has: its value, an extra metric, or a
    degree of its plan (`plan.<unit>.<degree>`, as every run's summary states it)."""
    fields = ["value", *spec.extra_metrics]
    if field_name not in fields and not PLAN_FIELD.fullmatch(field_name):
        raise ConfigError(
            f"{where}: preset {spec.name}'s results have no field {field_name!r} (its fields: {fields}, plan.<unit>.<degree>)"
        )


def _headline(row: dict[str, Any], paper: str, figure: str, context: _Context) -> Headline:
    where = f"{context.file}, headline {row.get('id', '?')!r}"
    _require(row, ("id", "quantity", "paper", "kind", "where"), where)
    if row["kind"] not in KINDS:
        raise ConfigError(f"{where}: kind {row['kind']!r} is not one of {list(KINDS)}")
    value = PaperValue.parse(row["paper"], where)
    locus = _locus(row, context, where)
    if (len(locus.groups) > 1) != bool(value.extreme):
        raise ConfigError(
            f"{where}: several groups go with an extreme ({{up_to: X}} or {{as_low_as: X}}), one group with any other value"
        )
    miss = _miss(row.get("miss"), context.preset(locus.preset, where), locus.groups[0], context, where, headline=True)
    return Headline(
        row["id"],
        paper,
        row.get("figure", figure),
        row["quantity"],
        value,
        row["kind"],
        row["where"],
        locus,
        row.get("quote", ""),
        miss,
    )


def _miss(raw: Any, spec: SweepSpec, group: str, context: _Context, where: str, headline: bool) -> tuple[Explanation, ...]:
    explanations = tuple(_explanation(e, spec, group, context, where, headline) for e in _as_list(raw))
    causes = [e.cause for e in explanations]
    if "unstated" in causes[1:] or NOT_EXPLAINED in causes[:-1]:
        raise ConfigError(f"{where}: an unstated cause comes first (the others explain what its range does not), 'not explained' last")
    return explanations


def _explanation(raw: Any, spec: SweepSpec, group: str, context: _Context, where: str, headline: bool) -> Explanation:
    if (
        not isinstance(raw, dict)
        or not {"cause", "evidence"} <= set(raw)
        or set(raw) - {"cause", "evidence", "sensitivity", "measured", "when", "errs"}
    ):
        raise ConfigError(f"{where}: a miss is {{cause, evidence}} (with sensitivity or measured), is {raw!r}")
    cause = raw["cause"]
    if cause not in [*CAUSES, NOT_EXPLAINED]:
        raise ConfigError(f"{where}: cause {cause!r} is not one of {[*CAUSES, NOT_EXPLAINED]}")
    sensitivity = tuple(_as_list(raw.get("sensitivity")))
    if (cause == "unstated") != bool(sensitivity):
        raise ConfigError(f"{where}: an unstated cause names the sensitivity sweeps of its declared ranges, and only it does")
    measured: dict[str, Measurement] = {}
    for name, entry in (raw.get("measured") or {}).items():
        if not isinstance(entry, dict) or len(entry) != 2 or "file" not in entry or not isinstance(entry.get("row", {}), dict):
            raise ConfigError(
                f"{where}: measurement {name!r} is {{file, row: {{key: value}}}} or {{file, at: dotted.path}}, is {entry!r}"
            )
        if not {"row", "at"} & set(entry):
            raise ConfigError(f"{where}: measurement {name!r} names its row or its path (at)")
        measured[name] = Measurement(entry["file"], dict(entry.get("row") or {}), str(entry.get("at", "")))
    if cause == "simulator" and not measured:
        raise ConfigError(f"{where}: a simulator cause names a measurement where the simulator errs the same way (measured)")
    when = str(raw.get("when", ""))
    if when not in ("", "above", "below") or (when and not headline):
        raise ConfigError(f"{where}: when is 'above' or 'below' (a headline's side of the paper's value), is {when!r}")
    errs = _errs(raw.get("errs"), measured, context, where)
    if (cause == "simulator") != bool(errs):
        raise ConfigError(f"{where}: a simulator cause says what in its measurements errs its way (errs), and only it does")
    evidence = " ".join(str(raw["evidence"]).split())
    _check_evidence(evidence, spec, group, measured, context, where, headline)
    return Explanation(cause, evidence, sensitivity, measured, when, errs)


MEASURED_TERM = re.compile(r"measured\.(\w+):(\S+)")


def _errs(raw: Any, measured: dict[str, Measurement], context: _Context, where: str) -> tuple[tuple[ErrsTerm, ErrsTerm], ...]:
    """The (a, b) pairs of a simulator cause's `errs`, each term a number or a measurement's
    field (its name and the field, which must resolve)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in raw):
        raise ConfigError(f"{where}: errs is a list of [a, b] pairs (a below b), is {raw!r}")
    out: list[tuple[ErrsTerm, ErrsTerm]] = []
    for pair in raw:
        terms: list[ErrsTerm] = []
        for term in pair:
            if isinstance(term, (int, float)) and not isinstance(term, bool):
                terms.append(float(term))
                continue
            match = MEASURED_TERM.fullmatch(str(term))
            if match is None or match.group(1) not in measured:
                raise ConfigError(f"{where}: an errs term is a number or measured.NAME:field of {sorted(measured)}, is {term!r}")
            measurement = measured[match.group(1)]
            measured_value(measurement, match.group(2), context.measurement_file(measurement.file, where), where)
            terms.append((match.group(1), match.group(2)))
        out.append((terms[0], terms[1]))
    return tuple(out)


def _check_evidence(
    text: str, spec: SweepSpec, group: str, measured: dict[str, Measurement], context: _Context, where: str, headline: bool
) -> None:
    """Every placeholder resolves (series, field and group of the preset; measurement row and
    field; a job's override), and no number stands outside one."""
    typed = typed_numbers(text)
    if typed:
        raise ConfigError(f"{where}: evidence states {typed} outside a placeholder (numbers come from results)")
    if not headline and ROW_PLACEHOLDER.search(text):
        raise ConfigError(f"{where}: {{ours}} and {{at}} are a headline's, not a claim's")
    labels = [g["label"] for g in spec.groups]
    for source, field_name, at in PLACEHOLDER.findall(text):
        if at and at not in labels:
            raise ConfigError(f"{where}: evidence names group {at!r}, not one of {spec.name}'s {labels}")
        if source.startswith("measured."):
            name = source.removeprefix("measured.")
            if name not in measured:
                raise ConfigError(f"{where}: evidence names measurement {name!r}, not one of {sorted(measured)}")
            measured_value(measured[name], field_name, context.measurement_file(measured[name].file, where), where)
        elif source.startswith("config."):
            config_value(spec, source.removeprefix("config."), field_name, at or group, where)
        elif source.startswith("paper."):
            paper_value(spec, source.removeprefix("paper."), field_name.removesuffix("%"), at or group, where)
        else:
            if source not in spec.series:
                raise ConfigError(f"{where}: evidence names series {source!r}, not one of {spec.name}'s {sorted(spec.series)}")
            if not job_overrides(spec, at or group, source):
                raise ConfigError(f"{where}: evidence names {source} in {at or group!r}, where preset {spec.name} does not run it")
            _check_field(spec, field_name.removesuffix("%"), where)


def measured_value(measurement: Measurement, field_name: str, content: Any, where: str) -> Any:
    """A field of the measurement's row (or entry) in its file; refused where it is gone."""
    if measurement.at:
        try:
            entry = lookup(content, measurement.at)
        except (KeyError, TypeError) as err:
            raise ConfigError(f"{where}: {measurement.file} has no entry {measurement.at!r}") from err
        named = measurement.at
    else:
        rows = [r for r in (content.get("rows") if isinstance(content, dict) else content) or [] if isinstance(r, dict)]
        found = [r for r in rows if all(r.get(k) == v for k, v in measurement.row.items())]
        if len(found) != 1:
            raise ConfigError(f"{where}: {measurement.file} has {len(found)} rows with {measurement.row} (one is needed)")
        entry, named = found[0], f"row {measurement.row}"
    try:
        return lookup(entry, field_name)
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{where}: {measurement.file}'s {named} has no field {field_name!r}") from err


_JOBS: dict[int, tuple[SweepSpec, dict[tuple[str, str], list[dict[str, str]]]]] = {}


def job_overrides(spec: SweepSpec, group: str, series: str) -> list[dict[str, str]]:
    """The overrides of each job (each variant) of a (group, series), as key -> value."""
    if id(spec) not in _JOBS:  # a spec is loaded once per Presets; its jobs are read many times
        jobs: dict[tuple[str, str], list[dict[str, str]]] = {}
        for job in figure_jobs(spec):
            if job.repeat:  # a timed repeat runs its job's overrides again
                continue
            overrides = {key: value for key, _, value in (o.partition("=") for o in job.overrides)}
            jobs.setdefault((job.group, job.series), []).append(overrides)
        _JOBS[id(spec)] = (spec, jobs)
    return _JOBS[id(spec)][1].get((group, series), [])


def config_value(spec: SweepSpec, series: str, key: str, group: str, where: str) -> str:
    """The value a preset's job sets for a key (the same in every variant), as written."""
    if series not in spec.series:
        raise ConfigError(f"{where}: evidence names series {series!r}, not one of {spec.name}'s {sorted(spec.series)}")
    values = {jobs.get(key) for jobs in job_overrides(spec, group, series)}
    if values == {None} or not values:
        raise ConfigError(f"{where}: preset {spec.name}'s {series} job in {group!r} sets no {key}")
    if len(values) > 1:
        raise ConfigError(f"{where}: preset {spec.name}'s {series} variants in {group!r} set {key} to {sorted(map(str, values))}")
    (value,) = values
    return str(value)


def paper_value(spec: SweepSpec, series: str, field_name: str, group: str, where: str) -> Any:
    """A value the preset's group states as the paper's (its reference data: `paper` for the
    figure's metric, `paper_extra` for another field)."""
    entry = next(g for g in spec.groups if g["label"] == group)
    values = (entry.get("paper") or {}) if field_name == "value" else (entry.get("paper_extra") or {}).get(field_name, {})
    if series not in values:
        raise ConfigError(f"{where}: preset {spec.name} states no paper value of {series} {field_name} in {group!r}")
    return values[series]


def _claim(row: dict[str, Any], paper: str, figure: str, context: _Context) -> Claim:
    where = f"{context.file}, claim {row.get('id', '?')!r}"
    _require(row, ("id", "claim", "where", "preset", "check"), where)
    spec = context.preset(row["preset"], where)
    check = dict(row["check"])
    _require(check, ("kind", "series", "groups"), where)
    if check["kind"] not in CHECKS:
        raise ConfigError(f"{where}: check kind {check['kind']!r} is not one of {list(CHECKS)}")
    field_name = check.get("field", row.get("field", "value"))
    _locus(
        {
            "preset": spec.name,
            "series": check["series"],
            "over": list(_claim_over(check)),
            "field": field_name,
        },
        context,
        where,
        check["groups"],
    )
    if check["kind"] in ("lowest", "highest", "largest_gap") and not check.get("than"):
        raise ConfigError(f"{where}: a {check['kind']} check needs 'than'")
    if check["kind"] == "largest_gap" and check.get("at") not in check["groups"]:
        raise ConfigError(f"{where}: largest_gap's 'at' must be one of its groups")
    miss = _miss(row.get("miss"), spec, check["groups"][0], context, where, headline=False)
    return Claim(row["id"], paper, row.get("figure", figure), row["claim"], row["where"], spec.name, field_name, check, miss)


def _claim_over(check: dict[str, Any]) -> tuple[str, ...]:
    """The series a claim's check reads beside its own: those it is compared with, and the one
    each is read per."""
    return (*check.get("than", []), *_as_list(check.get("per")))


def claim_locus(claim: Claim) -> Locus:
    """The series and groups a claim's check reads, as a locus."""
    check = claim.check
    return Locus(claim.preset, tuple(check["groups"]), check["series"], claim.field, _claim_over(check))


def _sensitivities(
    declared: dict[Any, dict[str, Any]], headlines: list[Headline], claims: list[Claim], context: _Context
) -> dict[str, Sensitivity]:
    """Each declared sensitivity, matched to the figure groups of every row that names it."""
    rows: dict[str, tuple[Locus, tuple[Explanation, ...]]] = {h.id: (h.locus, h.miss) for h in headlines}
    rows |= {c.id: (claim_locus(c), c.miss) for c in claims}
    users: dict[str, list[str]] = {}
    for row_id, (_, miss) in rows.items():
        for explanation in miss:
            for name in explanation.sensitivity:
                if name not in declared:
                    raise ConfigError(f"{context.file}, {row_id!r}: no sensitivity {name!r} in this catalogue")
                users.setdefault(name, []).append(row_id)
    out: dict[str, Sensitivity] = {}
    for name, entry in declared.items():
        where = f"{context.file}, sensitivity {name!r}"
        _require(entry, ("id", "range", "preset"), where)
        if entry["range"] not in context.ranges:
            raise ConfigError(f"{where}: no range {entry['range']!r} in {RANGES_FILE} (its ranges: {sorted(context.ranges)})")
        if name not in users:
            raise ConfigError(f"{where}: no row names it")
        declared_range = context.ranges[entry["range"]]
        spec = context.preset(entry["preset"], where)
        matches = {
            row_id: _match(rows[row_id][0], spec, declared_range, context, f"{where}, row {row_id!r}") for row_id in users[name]
        }
        out[name] = Sensitivity(name, declared_range, spec.name, matches)
    return out


def _match(locus: Locus, spec: SweepSpec, declared: Range, context: _Context, where: str) -> RowMatch:
    """For each figure group of a row, where each series it reads is at each value of the
    range: in the sensitivity group whose jobs are the figure's but for the parameter (a
    series that group skips, and would run as the figure does, at the figure's group); the
    figure's own group for the value its jobs set."""
    figure = context.preset(locus.preset, where)
    fields = {locus.field, locus.over_field or locus.field}
    series = list(locus.series_used)
    raw: dict[str, str] = {}
    normalize = None
    must_run = set()  # series the sensitivity groups must run themselves
    if "value" in fields:
        if (spec.metric, spec.normalize) == (figure.metric, figure.normalize):
            if spec.normalize:  # the sweep's own 'value' is normalised by its own run of that series
                series.append(spec.normalize["by"])
                must_run.add(spec.normalize["by"])
        else:  # the figure's 'value' from the metric as each preset reports it, normalised as the figure is
            raw = {spec.name: _raw_field(spec, figure.metric), figure.name: _raw_field(figure, figure.metric)}
            if not raw[spec.name]:
                raise ConfigError(
                    f"{where}: the row reads {figure.name}'s 'value' ({figure.metric}), which {spec.name} does not report "
                    f"(its metric {spec.metric}, normalize {spec.normalize}; its fields {spec.extra_metrics})"
                )
            normalize = figure.normalize
            series += [figure.normalize["by"]] if figure.normalize else []
    for name in fields - {"value"}:
        _check_field(spec, name, where)
    keys, shown = declared.keys, " / ".join(declared.keys)
    out: dict[str, tuple[Setting, ...]] = {}
    for group in locus.groups:
        jobs = {name: job_overrides(figure, group, name) for name in dict.fromkeys(series)}
        wanted = {}
        for name, runs in jobs.items():
            bare = [_without(job, keys) for job in runs]
            if not bare or any(job != bare[0] for job in bare):
                raise ConfigError(f"{where}: {figure.name}'s {name} jobs in {group!r} differ in more than {shown} (or it has none)")
            wanted[name] = bare[0]
        at: dict[str, Setting] = {}
        own = {value for runs in jobs.values() if len(runs) == 1 for value in _set_by(runs[0], keys)}
        if len(own) == 1 and (value := own.pop()) in declared.values:  # the figure's own setting
            at[value] = {name: (figure.name, group) for name in jobs}
        for candidate in spec.groups:
            found = _matching(spec, candidate, wanted, jobs, keys, (figure.name, group), must_run)
            if found is None:
                continue
            value, setting = found
            if value in at:
                raise ConfigError(
                    f"{where}: {shown}={value} matches {group!r} twice ({spec.name}'s {candidate['label']!r} and another)"
                )
            at[value] = setting
        if sorted(at) != sorted(declared.values):
            raise ConfigError(
                f"{where}: {spec.name}'s groups (and {figure.name}'s own) matching {figure.name}'s {group!r} (its jobs of "
                f"{list(wanted)} but for {shown}) set {shown} to {sorted(at)}, range {declared.id} declares "
                f"{list(declared.values)}{_nearest_difference(spec, wanted, keys)}"
            )
        out[group] = tuple(at[v] for v in declared.values)
        if raw and not raw[figure.name] and any(preset == figure.name for setting in out[group] for preset, _ in setting.values()):
            raise ConfigError(
                f"{where}: some settings read {figure.name}'s own results, which report {figure.metric} only normalised "
                f"(add it to its extra_metrics, or run every series in the sensitivity groups)"
            )
    return RowMatch(out, raw, normalize)


def _raw_field(spec: SweepSpec, metric: str) -> str:
    """The field of a preset's results holding a metric unnormalised ('' where none does)."""
    if metric in spec.extra_metrics:
        return metric
    return "value" if spec.metric == metric and not spec.normalize else ""


def _matching(
    spec: SweepSpec,
    group: dict[str, Any],
    wanted: dict[str, dict[str, str]],
    figure_jobs_of: dict[str, list[dict[str, str]]],
    keys: tuple[str, ...],
    figure_place: tuple[str, str],
    must_run: set[str],
) -> tuple[str, Setting] | None:
    """The parameter's value in a sensitivity group whose jobs are the wanted ones but for
    it, and where each series is read; None where the group does not match. The series it
    applies to set it; a series the group skips is read at the figure's group if the group
    would run it exactly as the figure does (it does not touch the parameter)."""
    values = set()
    setting: Setting = {}
    for series, job in wanted.items():
        runs = job_overrides(spec, group["label"], series)
        if not runs:
            if series in must_run:
                return None
            would = _unrun_job(spec, group, series)
            if would is None or len(figure_jobs_of[series]) != 1 or would != figure_jobs_of[series][0]:
                return None
            setting[series] = figure_place
            continue
        if len(runs) != 1 or _without(runs[0], keys) != job:
            return None
        values.update(_set_by(runs[0], keys))
        setting[series] = (spec.name, group["label"])
    return (values.pop(), setting) if len(values) == 1 else None


def _without(job: dict[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    """A job's overrides but the range's parameter."""
    return {k: v for k, v in job.items() if k not in keys}


def _set_by(job: dict[str, str], keys: tuple[str, ...]) -> set[str]:
    """The values a job sets the range's parameter to, under whichever of its spellings."""
    return {job[k] for k in keys if k in job}


def _nearest_difference(spec: SweepSpec, wanted: dict[str, dict[str, str]], keys: tuple[str, ...]) -> str:
    """What the closest sensitivity group's jobs set otherwise than the figure's (the drift to
    fix when a figure preset changed and its sweep did not)."""
    best: tuple[int, str] | None = None
    for group in spec.groups:
        differences = []
        for series, job in wanted.items():
            runs = job_overrides(spec, group["label"], series)
            if len(runs) != 1:
                continue
            ours = _without(runs[0], keys)
            differences += [
                f"{series} {k}={ours.get(k, '(unset)')} (figure: {job.get(k, '(unset)')})"
                for k in sorted(set(ours) | set(job))
                if ours.get(k) != job.get(k)
            ]
        if differences and (best is None or len(differences) < best[0]):
            best = (len(differences), f"; nearest, {group['label']!r}: " + ", ".join(differences[:3]))
    return best[1] if best else ""


def _unrun_job(spec: SweepSpec, group: dict[str, Any], series: str) -> dict[str, str] | None:
    """The overrides a group would give a series it skips (None: the preset has no such series,
    or it has variants)."""
    if series not in spec.series or series in spec.variants:
        return None
    overrides = spec.base + list(group.get("overrides", [])) + spec.series[series]
    overrides += list((group.get("series_overrides") or {}).get(series, []))
    return {k: v for k, _, v in (o.partition("=") for o in overrides)}
