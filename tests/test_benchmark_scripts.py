"""The benchmark scripts speak the current CLI: every config override they write names a field of the
typed config, and every speed choice they force is one DDPTUNE_SPEED takes."""
from __future__ import annotations

import dataclasses
import re

from conftest import ROOT
from ddptune import config, speed

BENCH = ROOT / "benchmarks"
SOURCES = sorted(BENCH.glob("*.py"))
OVERRIDE = re.compile(r"\b(model|data|train|lora|eval)\.([a-z_0-9]+)=")
# a value written out whole (followed by a space, a quote, a bracket or punctuation)
FORCED = re.compile(r"DDPTUNE_SPEED=([a-z_0-9=,.]+)(?=[\s`'\"):;]|$)")


def test_every_override_names_a_config_field():
    sections = {f.name: {g.name for g in dataclasses.fields(f.default_factory())} for f in dataclasses.fields(config.Config)
                if f.default_factory is not dataclasses.MISSING}
    found = {(p.name, m.group(1), m.group(2)) for p in SOURCES for m in OVERRIDE.finditer(p.read_text())}
    assert len(found) > 20  # the scripts are read
    unknown = sorted(f"{name}: {s}.{k}" for name, s, k in found if k not in sections[s])
    assert not unknown, unknown


def test_every_forced_speed_choice_is_one_ddptune_takes(monkeypatch):
    # speed.py's `env:DDPTUNE_SPEED=a,env:DDPTUNE_SPEED=b` is two values
    values = {m.group(1).removesuffix(",env") for p in SOURCES for m in FORCED.finditer(p.read_text())}
    assert {"graphs=off", "combo=false"} <= values
    for value in values:
        monkeypatch.setenv(speed.FORCE_ENV, value)
        assert speed.forced(), value  # raises ConfigError for a key or value it does not know
