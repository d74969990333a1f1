"""The README and docs/ as a user reads them: every relative link leads somewhere, every
command pastes into a shell, names modules, scripts and presets that exist and composes
into a config the door accepts, every option of every config group is documented where a
reader looks for it, the README's set-up commands are what `.ci/run` runs, and its
reproduction table is the scorecard's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.config import options_from
from src.setup import validate
from tests.composing import composed
from tests.conftest import CONF_DIR, REPO_ROOT
from tests.test_configs import strategy_options

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
# Repository paths a page names in backticks or commands (not placeholders or globs).
REPO_PATH = re.compile(r"^(?:src|conf|sweeps|benchmarks|launchers|tests|docs|hydra_plugins)/[\w./-]*$")
# The front doors whose command lines are Hydra overrides of a config in conf/.
CONFIG_OF = {"src.run": "config", "src.prepare": "config", "src.compare": "compare"}


def _text(page: Path) -> str:
    return page.read_text()


def _name(page: Path) -> str:
    return str(page.relative_to(REPO_ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def _commands(page: Path) -> list[str]:
    """Each command line of the page's bash blocks, continuation lines joined."""
    lines = [line for block in BASH_BLOCK.findall(_text(page)) for line in block.replace("\\\n", " ").splitlines()]
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _python_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of each `python ...` command of every page, comments dropped."""
    return [
        (_name(page), argv)
        for page in PAGES
        for line in _commands(page)
        if (argv := shlex.split(line, comments=True)) and argv[0] == "python"
    ]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(_text(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.name}")
    assert not broken, f"{_name(page)}: {broken}"


def test_the_docs_are_linked_from_the_readme() -> None:
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in LINK.findall(_text(README))}
    assert not [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]


def test_no_command_holds_a_shell_redirection() -> None:
    """A placeholder such as `partition=<p>` is a redirection when pasted."""
    commands = []
    for page in PAGES:
        commands += _commands(page)
        commands += re.findall(r"`((?:python|mmdist|wandb) [^`]*)`", _text(page))
    pasted = [c for c in commands if re.search(r"<[^>]*>", c.split("#")[0])]
    assert commands and not pasted, pasted


def test_commands_name_what_exists() -> None:
    missing = []
    for page, argv in _python_commands():
        if argv[1] == "-m":
            module = REPO_ROOT / argv[2].replace(".", "/")
            if argv[2].startswith("src") and not (module.with_suffix(".py").is_file() or (module / "__main__.py").is_file()):
                missing.append(f"{page}: module {argv[2]}")
        for token in argv[1:]:
            for group in ("experiment", "comparison"):
                if token.startswith(f"+{group}=") and token != f"+{group}=NAME":
                    if not (CONF_DIR / group / f"{token.split('=', 1)[1]}.yaml").is_file():
                        missing.append(f"{page}: {token}")
    for page in PAGES:
        named = re.findall(r"`([^`\s]+)`", _text(page)) + [t for line in _commands(page) for t in shlex.split(line, comments=True)]
        missing += [f"{_name(page)}: {path}" for path in named if REPO_PATH.match(path) and not (REPO_ROOT / path).exists()]
    assert not missing, missing


def _overrides(argv: list[str]) -> list[str]:
    """The command's overrides as one job of it would compose them: a multirun's first
    value of each swept key; Hydra's own settings (directories, launchers) left out."""
    multirun = "-m" in argv
    out = []
    for token in argv[3:]:
        if token == "-m" or token.startswith("hydra"):
            continue
        key, _, value = token.partition("=")
        if multirun and "," in value and "[" not in value:
            value = value.split(",")[0]
        out.append(f"{key}={value}")
    return out


def test_every_front_door_command_composes_and_validates() -> None:
    """Each `python -m src.run|src.compare|src.prepare` line of the docs names
    options that exist, with values the door accepts (the model, cluster, train and
    backend settings built, the strategy's options read), without planning."""
    jobs: dict[tuple[str, ...], str] = {}  # composing is the slow part: each distinct job once
    for page, argv in _python_commands():
        if argv[1] == "-m" and argv[2] in CONFIG_OF and not any(t.startswith(("+experiment", "+comparison")) for t in argv):
            jobs.setdefault((CONFIG_OF[argv[2]], *_overrides(argv)), f"{page}: {' '.join(argv)}")
    for (config_name, *overrides), where in jobs.items():
        try:
            config = composed(overrides, config_name)
            validate(config)
            options_from(strategy_options(config["strategy"]["name"]), config["strategy"])
        except Exception as err:
            raise AssertionError(f"{where}: {err}") from None
    assert len(jobs) >= 15, sorted(jobs)


def _keys(tree: dict, prefix: str = "") -> list[str]:
    """Dotted leaf keys of a config file, `name` and Hydra's `defaults` aside."""
    out = []
    for key, value in tree.items():
        if key in ("name", "defaults"):
            continue
        out += _keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return out


def _documented(key: str, group: str, text: str) -> bool:
    return re.search(rf"`(?:{group}\.)?{re.escape(key)}(?=[`=\s])", text) is not None


def _sections(page: Path) -> dict[str, str]:
    parts = re.split(r"^## ", _text(page), flags=re.M)[1:]
    return {part.splitlines()[0]: part for part in parts}


@pytest.mark.parametrize("group,page", [("model", "running.md"), ("logger", "running.md"), ("backend", "real_backend.md")])
def test_every_option_of_a_group_is_documented(group: str, page: str) -> None:
    text = _text(DOCS / page)
    undocumented = {
        f"{group}={path.stem}: {key}"
        for path in sorted((CONF_DIR / group).glob("*.yaml"))
        for key in _keys(OmegaConf.to_container(OmegaConf.load(path)))
        if not _documented(key, group, text)
    }
    assert not undocumented, f"docs/{page} does not name: {sorted(undocumented)}"


def test_every_train_key_and_cluster_preset_is_documented() -> None:
    text = _text(DOCS / "running.md")
    train = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["train"]
    assert not [k for k in train if not _documented(k, "train", text)]
    presets = [p.stem for p in CONF_DIR.glob("cluster/*.yaml")]
    assert not [p for p in presets if f"`{p}`" not in text]
    assert not [k for k in ("nodes", "devices_per_node", "devices", "profile") if f"`cluster.{k}" not in text]


@pytest.mark.parametrize("strategy", sorted(p.stem for p in CONF_DIR.glob("strategy/*.yaml")))
def test_every_strategy_option_is_documented_in_its_section(strategy: str) -> None:
    """docs/strategies.md has one section per strategy, its heading naming it."""
    sections = [body for heading, body in _sections(DOCS / "strategies.md").items() if re.search(rf"\b{strategy}\b", heading.lower())]
    assert len(sections) == 1, f"docs/strategies.md: {len(sections)} sections name {strategy} in their heading"
    keys = _keys(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "strategy" / f"{strategy}.yaml")))
    assert not [k for k in keys if not _documented(k, "strategy", sections[0])], strategy


def test_ci_runs_exactly_the_readme_set_up_commands() -> None:
    set_up = BASH_BLOCK.findall(_text(README))[0].strip().splitlines()
    script = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in script if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert commands == set_up


def test_the_readme_shows_the_reproduction_summary() -> None:
    scorecard = (REPO_ROOT / "benchmarks" / "results" / "reproduction.md").read_text()
    summary = re.search(r"## Summary\n\n(\|.*?)\n\n", scorecard, re.S)
    assert summary, "benchmarks/results/reproduction.md has no summary table"
    assert summary.group(1) in _text(README), "README.md's reproduction table is not the scorecard's summary"
