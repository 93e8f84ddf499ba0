"""Learning-rate schedules: the rates a run logs are those transformers' schedule gives for its config, on
through a resume; a schedule that does not fit the run is refused before it starts."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import ROOT, checkpoints_kept, field, metrics
from ddptune import checks, config, step, train
from ddptune.config import ConfigError
from test_train import died_after

TINY = str(ROOT / "configs" / "tiny.yaml")


def rates(scheduler, steps: int) -> list[float]:
    """The learning rate of each of `steps` steps, as the run logs it (before the step's update)."""
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def test_cosine_with_a_floor_gives_transformers_rates():
    t = config.from_dict({"train": {"lr": 1e-3, "warmup_steps": 3, "lr_schedule": "cosine_with_min_lr",
                                    "min_lr_ratio": 0.2}}).train
    _, ours = step.build_optimizer(t, torch.nn.Linear(2, 2), 20)
    theirs = transformers.get_cosine_with_min_lr_schedule_with_warmup(optimizer(1e-3), 3, 20, min_lr_rate=0.2)
    got = rates(ours, 20)
    assert got == pytest.approx(rates(theirs, 20), abs=1e-12)
    assert got[3] == pytest.approx(1e-3) and min(got[3:]) == got[-1] and 2e-4 < got[-1] < 2.1e-4  # down to the floor
    plain = config.from_dict({"train": {"lr": 1e-3, "warmup_steps": 3}}).train
    assert rates(step.build_optimizer(plain, torch.nn.Linear(2, 2), 20)[1], 20)[-1] < 2e-4  # no floor


def test_warmup_stable_decay_logs_transformers_rates_and_resumes_on_them(tmp_path):
    args = ["train.max_steps=10", "train.warmup_steps=2", "train.lr_schedule=warmup_stable_decay", "train.min_lr_ratio=0.1",
            "train.decay_ratio=0.4", "train.save_every=5", "train.keep_checkpoints=3", "lora.dropout=0.0", "data.val=null"]
    full = tmp_path / "full"
    with checkpoints_kept():  # a finished run removes them; the resume below starts from one
        train.run(config.load(TINY, [f"output_dir={full}", *args]))
    logged = [r["lr"] for r in metrics(full) if "lr" in r]
    theirs = transformers.get_wsd_schedule(optimizer(1e-2), num_warmup_steps=2, num_decay_steps=4, num_training_steps=10,
                                           min_lr_ratio=0.1)
    want = rates(theirs, 10)
    assert logged == pytest.approx(want, abs=1e-12)
    assert want[2:6] == [1e-2] * 4 and want[-1] < 1e-2  # warm-up, the stable steps, then the decay
    part = died_after(full, tmp_path / "part", checkpoint_step=5, metric_lines=6)
    train.run(config.load(TINY, [f"output_dir={part}", *args]), resume=True)
    assert [r["lr"] for r in metrics(part) if "lr" in r] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("overrides, where", [
    (["train.lr_schedule=cosine", "train.min_lr_ratio=0.1"], "train.min_lr_ratio: cosine has no floor"),
    (["train.lr_schedule=cosine_with_min_lr", "train.min_lr_ratio=1"], "train.min_lr_ratio: must be in [0, 1)"),
    (["train.lr_schedule=warmup_stable_decay", "train.decay_ratio=0"], "train.decay_ratio: must be in (0, 1]"),
    (["train.lr_schedule=warmup_stable_decay", "train.max_steps=10", "train.warmup_steps=8", "train.decay_ratio=0.3"],
     "train.warmup_steps: 8 warm-up and 3 decay steps"),
])
def test_a_schedule_that_cannot_run_is_refused(overrides, where):
    problems = checks.check_values(config.load(TINY, overrides))
    assert len(problems) == 1 and problems[0].startswith(where)


def test_a_stable_decay_that_outlasts_the_epochs_is_refused_before_training(tmp_path):
    cfg = config.load(TINY, [f"output_dir={tmp_path / 'run'}", "train.max_steps=null", "train.epochs=0.01", "data.val=null",
                             "train.lr_schedule=warmup_stable_decay", "train.warmup_steps=1"])  # 0.01 x 400 rows / 4 = 1 step
    with pytest.raises(ConfigError) as e:
        train.run(cfg)
    (line,) = e.value.problems  # 1 warm-up step and 1 decay step do not fit a run of 1 step
    assert field(line) == "train.warmup_steps" and [w for w in line.split() if w.isdigit()] == ["1", "1", "1"], line
    assert not (tmp_path / "run" / "adapter").exists()
