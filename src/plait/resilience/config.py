"""The resilience settings of a run (``--fault-tolerance`` and friends), and the checks that
a layout can be run resiliently. Owned by ``plait.resilience``; carried by ``RunConfig``.

Communication: none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MIN_HEARTBEAT_S = 3.0  # below this, a busy machine's scheduling jitter would look like a hang
SIGNALS = ("kill", "stop")  # SIGKILL (a crash), SIGSTOP (a hang, found by the heartbeat)
KINDS = (*SIGNALS, "save")  # save: SIGKILL while it writes the checkpoint of that step


@dataclass(frozen=True, kw_only=True)
class Injection:
    """Kill worker ``worker`` during step ``step`` (1-based, as in metrics.jsonl): SIGKILL
    at a random point of the step, SIGSTOP (``stop``), or SIGKILL while it writes that
    step's checkpoint (``save``)."""

    step: int
    worker: int
    signal: str = "kill"

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"--inject-failure {self}: the step must be >= 1")
        if self.worker < 0:
            raise ValueError(f"--inject-failure {self}: the worker must be >= 0")
        if self.signal not in KINDS:
            raise ValueError(f"--inject-failure {self}: {self.signal!r}; use kill, stop or save")

    def __str__(self) -> str:
        return f"{self.step}:{self.worker}" + (f":{self.signal}" if self.signal != "kill" else "")


def parse_injections(text: str) -> tuple[Injection, ...]:
    """``"5:1,9:3:stop,10:0:save"`` -> kill worker 1 in step 5, stop worker 3 in step 9,
    kill worker 0 while it writes the checkpoint of step 10."""
    out = []
    for item in filter(None, (x.strip() for x in str(text).split(","))):
        parts = item.split(":")
        try:
            step, worker = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            raise ValueError(
                f"--inject-failure {item!r}: expected STEP:WORKER[:stop|:save], e.g. 5:1 or 9:3:stop"
            ) from None
        if len(parts) > 3:
            raise ValueError(f"--inject-failure {item!r}: expected STEP:WORKER[:stop|:save]")
        out.append(
            Injection(step=step, worker=worker, signal=parts[2] if len(parts) == 3 else "kill")
        )
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """``fault_tolerance`` F > 0: the run keeps at least F + 1 copies of every layer (as
    F + 1 or more pipelines) and survives F workers dying at once in place; 0: a failure
    ends the run (the launcher's liveness and checkpoints still apply)."""

    fault_tolerance: int = 0
    heartbeat_timeout: float = 10.0  # seconds without a heartbeat: the worker is hung
    inject_failure: tuple[Injection, ...] = ()
    chaos_every: int = 0  # kill a random worker every K steps (0: never)
    chaos_signal: str = "kill"
    chaos_seed: int = 0
    respawn: bool = True  # start a new worker for each dead one; it joins at a step boundary
    async_checkpoint: bool = False  # write checkpoints from a side thread (no collectives)
    verify_replicas: bool = False  # at the end, check every replica of every tensor is equal

    def __post_init__(self) -> None:
        if self.fault_tolerance < 0:
            raise ValueError(f"--fault-tolerance must be >= 0, got {self.fault_tolerance}")
        if self.heartbeat_timeout < MIN_HEARTBEAT_S:
            raise ValueError(
                f"--heartbeat-timeout {self.heartbeat_timeout:g}: use at least "
                f"{MIN_HEARTBEAT_S:g} s (shorter, a busy machine's pauses look like hangs)"
            )
        if self.chaos_every < 0:
            raise ValueError(f"--chaos-every must be >= 0, got {self.chaos_every}")
        if self.chaos_signal not in SIGNALS:
            raise ValueError(f"--chaos-signal {self.chaos_signal!r}: use kill or stop")
        if (self.inject_failure or self.chaos_every) and not self.fault_tolerance:
            raise ValueError(
                "--inject-failure and --chaos-every kill workers; they need "
                "--fault-tolerance F >= 1 for the run to survive"
            )

    @property
    def enabled(self) -> bool:
        return self.fault_tolerance > 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["inject_failure"] = ",".join(map(str, self.inject_failure))
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> ResilienceConfig:
        d = dict(d or {})
        if isinstance(d.get("inject_failure"), str):
            d["inject_failure"] = parse_injections(d["inject_failure"])
        return cls(**d)


FLAGS = {  # flag dest -> ResilienceConfig field
    "fault_tolerance": "fault_tolerance",
    "heartbeat_timeout": "heartbeat_timeout",
    "inject_failure": "inject_failure",
    "chaos_every": "chaos_every",
    "chaos_signal": "chaos_signal",
    "chaos_seed": "chaos_seed",
    "async_checkpoint": "async_checkpoint",
    "verify_replicas": "verify_replicas",
}


def from_values(values: dict) -> ResilienceConfig:
    """ResilienceConfig from merged flag values (config file and flags)."""
    fields = {f: values[k] for k, f in FLAGS.items() if values.get(k) is not None}
    if isinstance(fields.get("inject_failure"), str):
        fields["inject_failure"] = parse_injections(fields["inject_failure"])
    if values.get("no_respawn"):
        fields["respawn"] = False
    return ResilienceConfig(**fields)


def check_layout(res: ResilienceConfig, layout, *, nnodes: int = 1) -> None:
    """Raise ValueError (one line naming the flag) when ``layout`` cannot run with
    ``--fault-tolerance``: the unit of failure is one tp group (one worker at --tp 1)
    holding one pipeline stage."""
    if not res.enabled:
        if res.async_checkpoint:
            raise ValueError("--async-checkpoint needs --fault-tolerance F >= 1 (its runtime)")
        return
    f = res.fault_tolerance
    if layout.zero:
        _check_zero(f, layout, res)
    elif layout.dp < f + 1:
        raise ValueError(
            f"--fault-tolerance {f} keeps F+1 = {f + 1} copies of every layer, one per "
            f"pipeline, but --dp {layout.dp} gives {layout.dp} pipelines; use --dp >= {f + 1}"
        )
    if layout.tp > 1 and layout.zero:
        raise ValueError(
            f"--fault-tolerance with --tp {layout.tp} and --zero {layout.zero} is not covered "
            "yet (ZeRO shards inside a replica's stages of one worker); drop --zero or use --tp 1"
        )
    if layout.tp > 1 and res.async_checkpoint:
        raise ValueError(
            f"--async-checkpoint with --tp {layout.tp} is not covered yet (its writer names "
            "no tp shards); drop --async-checkpoint (checkpoints are then written in step)"
        )
    if layout.pp_layout is not None:
        raise ValueError(
            "--fault-tolerance plans the stages itself (templates balanced by the simulator's "
            "costs); drop --pp-layout"
        )
    if nnodes > 1 and layout.world_size % nnodes:
        raise ValueError(
            f"--nnodes {nnodes} does not divide the {layout.world_size} workers of the layout"
        )
    if nnodes > 1 and (layout.world_size // nnodes) % layout.tp:
        raise ValueError(
            f"--fault-tolerance with --tp {layout.tp} keeps each tp group on one node, but "
            f"--nnodes {nnodes} gives {layout.world_size // nnodes} workers a node; use a "
            f"--tp that divides {layout.world_size // nnodes}"
        )


def _check_zero(f: int, layout, res: ResilienceConfig) -> None:
    """ZeRO under ``--fault-tolerance`` (stages 1-3): sharded inside replicas of K
    pipelines (hybrid sharding, ``assignment.py``), F + 1 replicas, so that every shard has
    F + 1 copies."""
    k = layout.zero_shard_group
    if k == 1:
        raise ValueError("--zero-shard-group 1 shards nothing; use --zero 0")
    if k is None or k == layout.dp:
        raise ValueError(
            f"--fault-tolerance {f} with --zero {layout.zero} needs F+1 = {f + 1} copies of "
            "every shard: shard inside replicas with --zero-shard-group K, --dp a multiple "
            f"of K with --dp / K >= {f + 1} (e.g. --dp {2 * (f + 1)} --zero-shard-group 2)"
        )
    if layout.dp // k < f + 1:
        raise ValueError(
            f"--fault-tolerance {f} keeps F+1 = {f + 1} copies of every shard, one per "
            f"replica, but --dp {layout.dp} / --zero-shard-group {k} gives {layout.dp // k}; "
            f"use --dp >= {k * (f + 1)}"
        )
    if layout.offload_optimizer:
        raise ValueError(
            "--fault-tolerance with --offload-optimizer: the state copy moves device tensors "
            "only; drop --offload-optimizer"
        )
