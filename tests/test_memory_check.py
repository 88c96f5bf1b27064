"""``plait train``'s memory check: the estimated peak per rank (``plait simulate``'s) against
the device's memory -- on this CPU host, MemAvailable over the workers started here --
refused in one line, exit 2, before any worker starts and before the data is prepared;
``--dry-run`` says "does not fit"; ``--skip-memory-check`` starts anyway."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from plait.cli import main
from plait.commands import train as train_cmd
from plait.sim import hardware

GiB = 2**30
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture
def no_start(monkeypatch):
    """Preparing data or starting workers fails the test: a refusal comes before both."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the run went on past the memory check")

    monkeypatch.setattr("plait.data.prepare", forbidden)
    monkeypatch.setattr("plait.train.launch.launch", forbidden)


def _host(monkeypatch, gib: float) -> None:
    """This host's MemAvailable, fixed (so that the test does not depend on the machine)."""
    monkeypatch.setattr("plait.sim.hardware.host_mem_available", lambda path="": gib * GiB)


def test_hidden_16384_is_refused_in_one_line_before_anything_starts(capsys, no_start, tmp_path):
    """``plait train --hidden 16384`` on this machine (its real MemAvailable): ~200 GiB per
    rank estimated. Catches a check that reads the limit wrong, runs after the data is
    prepared or the run folder is claimed, or prints more than one line."""
    out = tmp_path / "run"
    assert main(["train", "--hidden", "16384", "--out", str(out)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""  # nothing prepared, nothing started
    (line,) = cap.err.strip().splitlines()
    assert line.startswith("plait train: error: does not fit: peak ~"), line
    estimate = float(re.search(r"peak ~([\d.]+) GiB", line)[1])
    assert estimate > 150  # 12.95 B parameters in fp32 with AdamW, on one worker
    assert "available (the host's MemAvailable over 1 worker)" in line
    assert "--skip-memory-check" in line
    assert not out.exists()  # the folder was not even claimed


def test_huge_micro_batch_is_refused_with_a_layout_that_fits(capsys, monkeypatch, no_start):
    """A micro-batch of 4,096 sequences of the tiny model: its activations do not fit a
    16 GiB host; the refusal names the nearest layout that fits (``plan``'s search), and
    that layout does fit. Catches a check that ignores activations (the model state is
    0.02 GiB) and a suggestion that does not fit either."""
    _host(monkeypatch, 16)
    flags = ["--micro-batch-size", "4096", "--global-batch-size", "4096"]
    assert main(["train", *flags]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "does not fit" in line and "16.0 GiB available" in line, line
    suggested = re.search(r"nearest layout that fits: (.*?) \(~", line)[1]
    assert "--micro-batch-size" in suggested
    assert main(["train", "--dry-run", "--global-batch-size", "4096", *shlex.split(suggested)]) == 0
    assert "plait train --dry-run: ok:" in capsys.readouterr().out


def test_dry_run_says_does_not_fit_and_skip_memory_check_overrides(capsys, monkeypatch, tmp_path):
    """``--dry-run --hidden 16384`` says "does not fit" (exit 2) where it said "ok";
    ``--skip-memory-check`` goes back to "ok" (exit 0), and a run with it passes the check
    (it reaches the data preparation)."""
    _host(monkeypatch, 16)
    assert main(["train", "--dry-run", "--hidden", "16384"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("plait train --dry-run: does not fit: 12,954,992,640 parameters")
    assert "16.0 GiB available" in out and "no layout of as many workers fits" in out
    assert main(["train", "--dry-run", "--hidden", "16384", "--skip-memory-check"]) == 0
    assert capsys.readouterr().out.startswith("plait train --dry-run: ok: 12,954,992,640")

    reached = []

    def stop(*args, **kwargs):
        reached.append(True)
        raise ValueError("stopped at the data")

    monkeypatch.setattr("plait.data.prepare", stop)
    out = str(tmp_path / "run")
    assert main(["train", "--hidden", "16384", "--skip-memory-check", "--out", out]) == 2
    assert reached and "stopped at the data" in capsys.readouterr().err


def test_the_limit_is_mem_available_over_the_local_workers(tmp_path):
    """/proc/meminfo's MemAvailable (kB), divided among the workers this host starts."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   16777216 kB\n")
    assert hardware.host_mem_available(str(meminfo)) == 16 * GiB
    assert hardware.host_mem_available(str(tmp_path / "absent")) is None
    assert hardware.host_mem_available() > 0  # this host's


def test_readme_train_commands_are_far_from_the_limit(capsys, monkeypatch):
    """Every ``plait train`` line of the README that starts a run of the default model
    (not a dry run, a refusal, a resume or a file of its own) estimates at most half of
    what an 8 GiB host gives each of its workers: the check never stops the quick start."""
    _host(monkeypatch, 8)
    skip = ("--dry-run", "--hidden", "--resume", "--config", "--data", "--init-hf", "--out")
    lines = [m[1] for m in re.finditer(r"^(plait train(?: [^#\n]*)?)", README.read_text(), re.M)]
    commands = [shlex.split(x)[2:] for x in lines if not any(f in x for f in skip)]
    assert len(commands) >= 8, lines
    for args in commands:
        assert main(["train", "--dry-run", *args]) == 0, args
        out = capsys.readouterr().out
        m = re.search(r"peak ~([\d.]+) ([GM]iB) .*?([\d.]+) ([GM]iB)", out)
        estimate, limit = (float(x) * (1 if u == "GiB" else 2**-10) for x, u in
                           (m.groups()[:2], m.groups()[2:]))  # fmt: skip
        assert estimate <= limit / 2, (args, out)


def test_on_a_gpu_the_limit_is_the_devices_memory(monkeypatch):
    """With CUDA (stood in for: no GPU here) the limit is the device's total memory and the
    estimate uses that GPU's hardware entry (its framework overhead). Catches the host's
    memory used as a GPU's limit."""
    import types

    import torch

    props = types.SimpleNamespace(total_memory=80 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    hw, where = train_cmd._local_device(8)
    assert hw.memory_bytes == 80 * GiB and hw.name == "h100-sxm"
    assert where == "on the NVIDIA H100 80GB HBM3"


def test_the_end_of_run_sample_never_loads_a_large_model_in_the_launcher(monkeypatch, capsys,
                                                                         tmp_path):  # fmt: skip
    """After a run the launcher samples text from its checkpoint, which loads the whole model
    into one process. Catches that done for a model whose fp32 weights crowd the host's
    memory or whose sampling would take minutes on its CPU (a 175B run would end by
    gathering 700 GB into the launcher): the report names why and points at plait
    generate, without touching the checkpoint. The tiny default model is still sampled."""
    import types

    import torch

    from plait.model.config import preset

    def cfg(name):
        return types.SimpleNamespace(model=preset(name), out=str(tmp_path))

    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # a large host's CPU
    assert train_cmd._sample_too_big(cfg("tiny"), available=8 * GiB) is None
    assert train_cmd._sample_too_big(cfg("gpt2-124m"), available=8 * GiB) is None
    memory = train_cmd._sample_too_big(cfg("gpt3-175b"), available=2**40)
    assert memory and "more than half this host's available memory" in memory
    slow = train_cmd._sample_too_big(cfg("gpt3-13b"), available=2**40)
    assert slow and "would take" in slow and "s on this host's CPU" in slow

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    monkeypatch.setattr("plait.generate.generate_text",
                        lambda *a, **k: pytest.fail("the checkpoint was loaded"))  # fmt: skip
    train_cmd._report(cfg("gpt3-175b"))
    out = capsys.readouterr().out
    assert "no sample:" in out and f"plait generate --run {tmp_path}" in out


def test_sampling_refuses_a_model_larger_than_the_host_in_one_line(monkeypatch, tmp_path):
    """``plait generate`` and ``plait export --quantize`` run the whole model in one
    process. Catches a load that starts allocating a model the host cannot hold (an
    out-of-memory kill, not a line): the refusal comes from the config alone, before the
    model is built, and names the sizes and what works instead."""
    import types

    from plait import generate
    from plait.model.config import preset
    from plait.model.sizes import num_params

    big = types.SimpleNamespace(model=preset("gpt3-175b"))
    monkeypatch.setattr(generate, "locate", lambda run, trust=None: (big, tmp_path))
    monkeypatch.setattr(generate, "build_as_trained",
                        lambda cfg: pytest.fail("the model was built"))  # fmt: skip
    monkeypatch.setattr("plait.sim.hardware.host_mem_available", lambda path="": 64 * GiB)
    with pytest.raises(ValueError) as e:
        generate.load_model(tmp_path)
    line = str(e.value)
    assert "\n" not in line and f"--run {tmp_path}" in line
    need = 4 * num_params(big.model) / GiB  # 650 GiB
    assert f"{need:.1f} GiB in fp32" in line and "64.0 GiB available" in line
    assert "plait export" in line
    generate.check_host_memory(types.SimpleNamespace(model=preset("tiny")), "--run x")


def test_a_limit_below_a_gib_is_shown_in_mib():
    """A host's memory shared by many workers can be a few MiB each; "0.0 GiB available"
    hid how little. Catches the GiB-only format."""
    from plait.commands.train import MemoryFit

    line = MemoryFit(28.4 * 2**30, 23 * 2**20, "available (the host's)").summary()
    assert line == "peak ~28.4 GiB per rank estimated, 23 MiB available (the host's)", line
