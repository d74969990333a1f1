"""Bounds from physics and size (src.bounds), checked when the config is validated: every
preset lies within them; a figure no real device has (1e-30 FLOP/s, 1 B/s of memory
bandwidth) is one line naming the figure, its bounds and how to lift them for a what-if
study; a count past the size bounds is refused before anything is built; a scalar where a
mapping goes is named. (src.fuzz sends such values through Hydra's parser.)"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest

from src.bounds import MAX_LAYERS, MAX_SIZE
from src.cluster import cluster_from_config
from src.errors import ConfigError
from src.config import group_options
from src.models.registry import build_model
from src.setup import validate
from tests.composing import composed


@functools.cache
def _preset(name: str) -> dict[str, Any]:
    return composed([f"cluster={name}"])["cluster"]


def _cluster(**figures: Any) -> dict[str, Any]:
    """p3_16xlarge's config with `figures` set (peak_flops_<precision> sets one peak)."""
    config = {**_preset("p3_16xlarge"), "peak_flops": dict(_preset("p3_16xlarge")["peak_flops"])}
    for key, value in figures.items():
        if key.startswith("peak_flops_"):
            config["peak_flops"][key.removeprefix("peak_flops_")] = value
        else:
            config[key] = value
    return config


@pytest.mark.parametrize("cluster", group_options("cluster"))
def test_every_preset_is_within_the_bounds(cluster: str) -> None:
    cluster_from_config(_preset(cluster))


@pytest.mark.parametrize(
    "figures,line",
    [
        (
            {"peak_flops_fp16": 1e-30},
            r"^cluster\.peak_flops\.fp16=1e-30 FLOP/s is outside 1e\+08 to 1e\+17 FLOP/s \(.+; cluster p3_16xlarge\); "
            r"a what-if study of such a device: \+cluster\.what_if=true$",
        ),
        ({"memory_bandwidth": 1}, r"^cluster\.memory_bandwidth=1 B/s is outside 1e\+08 to 1e\+14 B/s \("),
        ({"inter_latency": 5}, r"^cluster\.inter_latency=5 s is outside 0 to 0\.1 s \("),
        ({"copy_efficiency": 1.5}, r"^cluster\.copy_efficiency is a fraction of peak, got 1\.5 \(cluster p3_16xlarge\)$"),
        ({"intra_bandwidth": 1e20}, r"^cluster\.intra_bandwidth=1e\+20 B/s is outside 1e\+06 to 1e\+13 B/s \("),
        ({"nodes": 99999999999999999999}, r"^cluster p3_16xlarge: 99999999999999999999 nodes x 8 devices, .+ 1048576 devices"),
    ],
)
def test_a_figure_no_device_has_is_one_line_naming_it(figures: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError, match=line):
        cluster_from_config(_cluster(**figures))


def test_a_what_if_study_lifts_the_physical_bounds_not_the_checks() -> None:
    assert cluster_from_config(_cluster(peak_flops_fp16=1e-30, what_if=True)).peak_flops["fp16"] == 1e-30
    with pytest.raises(ConfigError, match=r"cluster\.memory_bandwidth must be positive"):
        cluster_from_config(_cluster(memory_bandwidth=-1, what_if=True))
    with pytest.raises(ConfigError, match=r"^cluster\.what_if must be true or false, got 'yes'"):
        cluster_from_config(_cluster(what_if="yes"))


@pytest.mark.parametrize(
    "figures,line",
    [
        (
            {"peak_flops": 1e15},
            r"^cluster\.peak_flops is a group of settings, got 1000000000000000\.0; set one entry of it, e\.g\. cluster\.peak",
        ),
        ({"sources": 3}, r"^cluster\.sources is a group of settings, got 3; "),
    ],
)
def test_a_scalar_where_a_mapping_goes_is_named(figures: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError, match=line):
        cluster_from_config(_cluster(**figures))


@pytest.mark.parametrize(
    "overrides,key,limit",
    [
        (["model.vision.layers=99999999999999999999"], "model.vision.layers=99999999999999999999", MAX_LAYERS),
        (["model=gpt", "model.layers=1000000000"], "model.layers=1000000000", MAX_LAYERS),
        (["model=gpt", "model.hidden=100000000000"], "model.hidden=100000000000", MAX_SIZE),
        (["model=unet", "model.channel_mult=[1,100000000000]"], "model.channel_mult=100000000000", MAX_SIZE),
    ],
)
def test_a_count_past_the_size_bounds_is_refused_before_anything_is_built(overrides: list[str], key: str, limit: int) -> None:
    config = composed(overrides)
    start = time.process_time()
    with pytest.raises(ConfigError, match=rf"^{key}: at most {limit} \("):
        build_model(config["model"])
    assert time.process_time() - start < 1.0  # nothing of its size was built


def test_a_size_within_the_bounds_is_left_to_the_planners() -> None:
    validate(composed(["model=gpt", f"model.layers={MAX_LAYERS}", "model.preset=gpt_5b"]))
