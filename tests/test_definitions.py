"""The ideas defined once (issue #26): the list parser and the checkpoint grammar, the registry type, HarmSpec."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec
from kvdiag.core.parsing import parse_checkpoints, parse_list
from kvdiag.core.registry import Registry


def test_the_list_parser_accumulates_converts_bounds_and_refuses_repeats():
    assert parse_list(["128,256", "512"], "--budget", int, low=1) == [128, 256, 512]
    assert parse_list(None, "--x") == []
    assert parse_list(["0.1, 0.5"], "--rho", float, low=0, high=1, strict=True) == [0.1, 0.5]
    for bad, match in ((["1,x"], "--budget 1,x: use comma-separated integers"), (["0"], "--budget 0"),
                       (["4,4"], "4 is given twice")):
        with pytest.raises(UserError, match=match):
            parse_list(bad, "--budget", int, low=1)
    with pytest.raises(UserError, match="--rho 1"):
        parse_list(["1"], "--rho", float, low=0, high=1, strict=True)
    with pytest.raises(UserError, match="one of token, layer, head"):
        parse_list(["token,tok"], "--granularity", str, choices=("token", "layer", "head"))


def test_one_checkpoint_grammar():
    assert parse_checkpoints("every:64") == 64 and parse_checkpoints("default") == 128
    assert parse_checkpoints("384,256") == [256, 384]
    for bad in ("every:0", "every:x", "soon", "256,256", "0,3", ""):
        with pytest.raises(UserError, match="--checkpoints"):
            parse_checkpoints(bad)


def test_one_registry_type():
    reg: Registry = Registry("widget", hint="load yours with --plugin")

    def make(name):
        reg.add(name, name.upper())

    reg.add_resolver("w:", make, expand=lambda name: ["w:a", "w:b"] if name == "w:all" else None)
    reg.add("plain", "PLAIN")
    reg.add("plain", "PLAIN")  # the same entry again: fine
    with pytest.raises(UserError, match="widget name 'plain' is taken"):
        reg.add("plain", "OTHER")
    assert reg.resolve("w:x") == "W:X" and "w:x" in reg  # made on first use
    assert reg.expand(["plain", "w:all", "plain"]) == ["plain", "w:a", "w:b"]
    with pytest.raises(UserError, match="unknown widget 'nope'.*load yours with --plugin"):
        reg.resolve("nope")


def test_one_harm_spec_and_one_nan_rule():
    labels = pl.DataFrame({"kl_mean": [1e-9, 0.1, 0.2, 0.3, 5.0], "noise_floor": [1e-8] * 5})
    spec = HarmSpec()
    assert spec.analysed(labels).height == 4  # the label at its floor is unresolved
    assert HarmSpec(include_unresolved=True).analysed(labels).height == 5
    assert spec.threshold(np.array([0.1, 0.2, 0.3, 5.0])) == pytest.approx(np.quantile([0.1, 0.2, 0.3, 5.0], 0.9))
    assert math.isnan(spec.threshold(np.array([])))
    with pytest.raises(UserError, match="noise_floor is missing"):
        spec.analysed(labels.with_columns(noise_floor=pl.lit(None, pl.Float64)))
    assert HarmSpec(include_unresolved=True).analysed(labels.with_columns(noise_floor=pl.lit(None, pl.Float64))).height
    with pytest.raises(UserError, match="kl_mean is missing or NaN"):
        spec.analysed(labels.with_columns(kl_mean=pl.lit(float("nan"))))
    with pytest.raises(UserError, match="--harm"):
        HarmSpec("quantile:2")
    cfg = {"harm": "abs:0.01", "noise_mult": 2.0, "include_unresolved": True}
    assert HarmSpec.from_config(cfg).to_config() == cfg
    assert HarmSpec.from_configs(("a", None), ("b", cfg)) == (HarmSpec.from_config(cfg), "b")
