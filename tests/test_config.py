"""nemo_dcr_callback/config.py: the callback's options (DCRConfig) as configs/dcr.yaml documents
them, and how DCRCallback takes them (a config, keyword overrides, refusals)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import nemo_dcr_callback
from nemo_dcr_callback import DCRCallback
from nemo_dcr_callback.config import DCRConfig

DCR_YAML = Path(nemo_dcr_callback.__file__).parent / "configs" / "dcr.yaml"  # (the top-level configs/ links here)
INTERPOLATION = re.compile(r"^\$\{[^}]+\}$")  # ${model.vocab_size}: filled in from the rest of the config


def _documented() -> dict:
    return yaml.safe_load(DCR_YAML.read_text())["dcr"]


def _defaults() -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(DCRConfig)}


def test_yaml_documents_every_option():
    doc = _documented()
    assert doc["_target_"] == "nemo_dcr_callback.DCRCallback" and nemo_dcr_callback.DCRCallback is DCRCallback
    assert set(doc) - {"_target_"} == set(_defaults())


def test_yaml_defaults_are_the_configs_defaults():
    """Every option the YAML gives a plain value has DCRConfig's default there (an option
    interpolated from the rest of the config, like vocab_size, is left to that)."""
    doc, defaults = _documented(), _defaults()
    interpolated = {k for k, v in doc.items() if isinstance(v, str) and INTERPOLATION.match(v)}
    assert interpolated == {"vocab_size"}  # (a new one is a decision: say so here)
    differ = {k: (doc[k], defaults[k]) for k in defaults if k not in interpolated
              and (doc[k] != defaults[k] or isinstance(doc[k], bool) != isinstance(defaults[k], bool))}
    assert differ == {}, f"configs/dcr.yaml vs DCRConfig (yaml, default): {differ}"


def test_callback_takes_a_config_and_keyword_overrides():
    cb = DCRCallback(DCRConfig(every_n_steps=2), zstd_level=3)
    assert cb.cfg.every_n_steps == 2 and cb.cfg.zstd_level == 3
    assert cb.cfg.publisher_config().level == 3  # and the sender's config is built from it
    assert DCRCallback(zstd_level=3).cfg == dataclasses.replace(DCRConfig(), zstd_level=3)


def test_unknown_options_are_refused_by_name():
    with pytest.raises(TypeError, match=re.escape("unknown options ['bogus', 'every_n_step']")):
        DCRCallback(every_n_step=2, bogus=1)
    with pytest.raises(TypeError, match="unknown options"):
        DCRCallback(DCRConfig(), bogus=1)


def test_every_n_steps_below_one_is_refused():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        DCRConfig(every_n_steps=0)
    with pytest.raises(ValueError, match="DCRCallback: every_n_steps must be >= 1"):
        DCRCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        DCRCallback(DCRConfig(), every_n_steps=0)
