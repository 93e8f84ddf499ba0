"""The benchmark scripts speak the current CLI: they parse, every config override they write names a
field of the typed config, every speed choice they force is one DDPTUNE_SPEED takes, and
scaling_x2.sh documents each of its parts and runs each part it documents."""
from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest

from conftest import ROOT
from ddptune import config, speed

BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.sh"))
SOURCES = SCRIPTS + sorted(BENCH.glob("*.py"))
OVERRIDE = re.compile(r"\b(model|data|train|lora|eval)\.([a-z_0-9]+)=")
# a value written out whole (followed by a space, a quote, a bracket or punctuation), and a default in ${X_SPEED:-...}
FORCED = re.compile(r"DDPTUNE_SPEED=([a-z_0-9=,.]+)(?=[\s`'\"):;]|$)|SPEEDS?:-([a-z_0-9=,. -]+)\}")


def test_every_script_parses():
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script.name}: {proc.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_finds_nothing():
    proc = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_every_override_names_a_config_field():
    sections = {f.name: {g.name for g in dataclasses.fields(f.default_factory())} for f in dataclasses.fields(config.Config)
                if f.default_factory is not dataclasses.MISSING}
    found = {(p.name, m.group(1), m.group(2)) for p in SOURCES for m in OVERRIDE.finditer(p.read_text())}
    assert len(found) > 20  # the scripts are read
    unknown = sorted(f"{name}: {s}.{k}" for name, s, k in found if k not in sections[s])
    assert not unknown, unknown


def test_every_forced_speed_choice_is_one_ddptune_takes(monkeypatch):
    # SPEEDS lists several; "-" forces nothing; speed.py's `env:DDPTUNE_SPEED=a,env:DDPTUNE_SPEED=b` is two values
    values = {v.removesuffix(",env") for p in SOURCES for m in FORCED.finditer(p.read_text()) for g in m.groups() if g
              for v in g.split() if v != "-"}
    assert {"graphs=off", "graphs=step,lengths=4,dequantize=true"} <= values
    for value in values:
        monkeypatch.setenv(speed.FORCE_ENV, value)
        assert speed.forced(), value  # raises ConfigError for a key or value it does not know


def test_scaling_x2_documents_each_part_it_runs_and_runs_each_it_documents():
    text = (BENCH / "scaling_x2.sh").read_text()
    header = text[:text.index("set -euo pipefail")]
    cases = set(re.findall(r"^  ([a-z0-9-]+)\)$", text, re.M))
    documented = set(re.findall(r"^#   ([a-z0-9-]+) {2,}", header, re.M))
    assert {"defaults-8b", "recipe", "defaults-smollm2", "fsdp-qlora-8b", "gpu-tests"} <= cases
    assert cases == documented
    proc = subprocess.run(["bash", str(BENCH / "scaling_x2.sh"), "no-such-part"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": "/tmp/scaling_x2_usage"})
    assert proc.returncode == 1
    listed = set(proc.stderr.split("each of:")[1].split())
    assert listed == cases
