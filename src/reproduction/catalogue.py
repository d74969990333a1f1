"""The headline catalogue: one YAML file per paper (benchmarks/reproduction/<paper>.yaml).

A file lists the paper's figures and tables; each names the figure preset (sweeps/<preset>.yaml)
whose results hold ours, and lists
- headlines: one number the paper states (a value, [low, high] or {up_to: X}), where it says
  it, its kind (verdict.KINDS) and where ours is: a group (a list of groups for "up to" and
  "as low as"),
  a series and a field of that preset's results ('value', the figure's metric, or one of its
  extra_metrics), optionally over another series' field in the same group (`over`; a list
  means the smallest of them, e.g. "the most memory-efficient baseline"); and the cause of a
  miss with its evidence (`miss`), where `{series:field}` or `{series:field@group}` in the
  evidence is filled from the results;
- claims: qualitative statements (who wins, which way a trend goes), their check and, like
  a headline, the cause of a miss.
A figure's keys preset, series, field, kind and miss are its headlines' defaults.
`sensitivity` entries name a preset sweeping a parameter the paper leaves unstated (its
groups, or those listed under `group`, one per value), and the headline whose paper value they
are judged against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from src.errors import ConfigError
from src.reproduction.verdict import CAUSES, CHECKS, KINDS, PaperValue
from src.sweep import REPO, SweepSpec, load_sweep

CATALOGUE_DIR = REPO / "benchmarks" / "reproduction"
SWEEPS_DIR = REPO / "sweeps"


def papers_in(directory: Path = CATALOGUE_DIR) -> list[str]:
    """The papers a catalogue directory holds, one <paper>.yaml each."""
    return sorted(path.stem for path in directory.glob("*.yaml"))


PLACEHOLDER = re.compile(r"\{([^{}:@]+):([^{}@]+)(?:@([^{}]+))?\}")


@dataclass(frozen=True)
class Locus:
    """Where ours is: a field of a preset's rows (over another series' field, if `over`)."""

    preset: str
    groups: tuple[str, ...]
    series: str
    field: str
    over: tuple[str, ...] = ()


@dataclass(frozen=True)
class Miss:
    cause: str
    evidence: str


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
    miss: Miss | None = None


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
    miss: Miss | None = None


@dataclass(frozen=True)
class Sensitivity:
    id: str
    paper: str
    parameter: str
    headline: Headline
    locus: Locus  # its groups: one per value of the parameter
    note: str = ""


@dataclass(frozen=True)
class Catalogue:
    paper: str
    title: str
    text: str  # the paper's file in ../shared/papers/
    headlines: tuple[Headline, ...]
    claims: tuple[Claim, ...]
    sensitivities: tuple[Sensitivity, ...]

    def presets(self) -> list[str]:
        names = [h.locus.preset for h in self.headlines] + [c.preset for c in self.claims]
        names += [s.locus.preset for s in self.sensitivities]
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


def load_catalogue(paper: str, presets: Presets, directory: Path = CATALOGUE_DIR) -> Catalogue:
    """A paper's catalogue, every row checked to resolve to a preset, its groups, series and fields."""
    path = directory / f"{paper}.yaml"
    if not path.is_file():
        raise ConfigError(f"no catalogue for {paper!r} ({path} does not exist)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path.name} is not valid YAML: {str(err).splitlines()[0]}") from err
    where = path.name
    for key in ("paper", "title", "text", "figures"):
        if key not in raw:
            raise ConfigError(f"{where} lacks '{key}'")
    if raw["paper"] != paper:
        raise ConfigError(f"{where} says paper: {raw['paper']!r}, its file name {paper!r}")
    headlines: list[Headline] = []
    claims: list[Claim] = []
    for figure in raw["figures"]:
        defaults = {k: figure[k] for k in ("preset", "series", "field", "kind", "miss") if k in figure}
        for row in figure.get("headlines") or []:
            headlines.append(_headline({**defaults, **row}, paper, figure.get("figure", ""), presets, where))
        claim_defaults = {k: v for k, v in defaults.items() if k != "miss"}  # a figure's miss speaks of its headlines
        for row in figure.get("claims") or []:
            claims.append(_claim({**claim_defaults, **row}, paper, figure.get("figure", ""), presets, where))
    by_id = {h.id: h for h in headlines}
    sensitivities = [_sensitivity(row, paper, by_id, presets, where) for row in raw.get("sensitivity") or []]
    ids = [h.id for h in headlines] + [c.id for c in claims] + [s.id for s in sensitivities]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ConfigError(f"{where}: ids {repeated} appear more than once")
    return Catalogue(paper, raw["title"], raw["text"], tuple(headlines), tuple(claims), tuple(sensitivities))


def _require(row: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ConfigError(f"{where} lacks {missing}")


def _preset(presets: Presets, name: str, where: str) -> SweepSpec:
    try:
        return presets[name]
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err


def _locus(row: dict[str, Any], presets: Presets, where: str, groups: list[str] | None = None) -> Locus:
    _require(row, ("preset", "series"), where)
    spec = _preset(presets, row["preset"], where)
    labels = [g["label"] for g in spec.groups]
    if groups is None:
        _require(row, ("group",), where)
        groups = row["group"] if isinstance(row["group"], list) else [row["group"]]
    over = row.get("over") or []
    over = over if isinstance(over, list) else [over]
    field = row.get("field", "value")
    for group in groups:
        if group not in labels:
            raise ConfigError(f"{where}: preset {spec.name} has no group {group!r} (its groups: {labels})")
    for series in [row["series"], *over]:
        if series not in spec.series:
            raise ConfigError(f"{where}: preset {spec.name} has no series {series!r} (its series: {sorted(spec.series)})")
        skipped = [g["label"] for g in spec.groups if g["label"] in groups and series in (g.get("skip") or [])]
        if skipped:
            raise ConfigError(f"{where}: preset {spec.name} does not run {series} in {skipped}")
    _check_field(spec, field, where)
    return Locus(spec.name, tuple(groups), row["series"], field, tuple(over))


def _check_field(spec: SweepSpec, field: str, where: str) -> None:
    fields = ["value", *spec.extra_metrics]
    if field not in fields:
        raise ConfigError(f"{where}: preset {spec.name}'s results have no field {field!r} (its fields: {fields})")


def _headline(row: dict[str, Any], paper: str, figure: str, presets: Presets, file: str) -> Headline:
    where = f"{file}, headline {row.get('id', '?')!r}"
    _require(row, ("id", "quantity", "paper", "kind", "where"), where)
    if row["kind"] not in KINDS:
        raise ConfigError(f"{where}: kind {row['kind']!r} is not one of {list(KINDS)}")
    value = PaperValue.parse(row["paper"], where)
    locus = _locus(row, presets, where)
    if (len(locus.groups) > 1) != bool(value.extreme):
        raise ConfigError(
            f"{where}: several groups go with an extreme ({{up_to: X}} or {{as_low_as: X}}), one group with any other value"
        )
    miss = None
    if "miss" in row:
        miss = _miss(row["miss"], presets[locus.preset], locus.groups[0], where)
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


def _miss(raw: Any, spec: SweepSpec, group: str, where: str) -> Miss:
    if not isinstance(raw, dict) or set(raw) != {"cause", "evidence"}:
        raise ConfigError(f"{where}: miss must be {{cause, evidence}}, is {raw!r}")
    if raw["cause"] not in CAUSES:
        raise ConfigError(f"{where}: cause {raw['cause']!r} is not one of {list(CAUSES)}")
    labels = [g["label"] for g in spec.groups]
    for series, field, at in PLACEHOLDER.findall(raw["evidence"]):
        if series not in spec.series:
            raise ConfigError(f"{where}: evidence names series {series!r}, not one of {spec.name}'s {sorted(spec.series)}")
        if at and at not in labels:
            raise ConfigError(f"{where}: evidence names group {at!r}, not one of {spec.name}'s {labels}")
        _check_field(spec, field, where)
    return Miss(raw["cause"], raw["evidence"])


def _claim(row: dict[str, Any], paper: str, figure: str, presets: Presets, file: str) -> Claim:
    where = f"{file}, claim {row.get('id', '?')!r}"
    _require(row, ("id", "claim", "where", "preset", "check"), where)
    spec = _preset(presets, row["preset"], where)
    check = dict(row["check"])
    _require(check, ("kind", "series", "groups"), where)
    if check["kind"] not in CHECKS:
        raise ConfigError(f"{where}: check kind {check['kind']!r} is not one of {list(CHECKS)}")
    field = check.get("field", row.get("field", "value"))
    _locus(
        {"preset": spec.name, "series": check["series"], "over": check.get("than", []), "field": field},
        presets,
        where,
        check["groups"],
    )
    if check["kind"] in ("lowest", "highest", "largest_gap") and not check.get("than"):
        raise ConfigError(f"{where}: a {check['kind']} check needs 'than'")
    if check["kind"] == "largest_gap" and check.get("at") not in check["groups"]:
        raise ConfigError(f"{where}: largest_gap's 'at' must be one of its groups")
    miss = _miss(row["miss"], spec, check["groups"][0], where) if "miss" in row else None
    return Claim(row["id"], paper, row.get("figure", figure), row["claim"], row["where"], spec.name, field, check, miss)


def _sensitivity(row: dict[str, Any], paper: str, headlines: dict[str, Headline], presets: Presets, file: str) -> Sensitivity:
    where = f"{file}, sensitivity {row.get('id', '?')!r}"
    _require(row, ("id", "parameter", "preset", "headline", "series"), where)
    if row["headline"] not in headlines:
        raise ConfigError(f"{where}: no headline {row['headline']!r} in this catalogue")
    groups = row.get("group") or [g["label"] for g in _preset(presets, row["preset"], where).groups]
    groups = groups if isinstance(groups, list) else [groups]
    return Sensitivity(
        row["id"], paper, row["parameter"], headlines[row["headline"]], _locus(row, presets, where, groups), row.get("note", "")
    )
