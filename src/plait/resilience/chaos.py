"""Failures on purpose, for tests and demonstrations: ``--inject-failure STEP:WORKER[:stop]``
and ``--chaos-every K`` pick which real worker process the coordinator kills (SIGKILL: a
crash) or freezes (SIGSTOP: a hang, which only the heartbeat finds), and when.

Communication: none (the coordinator reads the workers' progress from the store and sends
the signal itself).

A kill lands inside the step, not at its start: after a delay drawn uniformly from
[0, the worker's last step time), so that over many kills every phase of a step -- the
forward, the pipeline messages, the gradient all-reduce, the statistics, the update, a
checkpoint being written -- gets hit. Draws come from ``random.Random(seed)``.

**A shot waits for the replacements, and the run waits with it.** A shot that falls due
while a replacement is on its way and the run holds F copies or fewer (a random kill: F
copies or fewer, whether or not one is coming) does not fire; the coordinator publishes
``hold_step()`` as ``ft/hold`` (a new generation's before its decision, which each member
reads as it forms the generation) and the members stop at the boundary before that step
until the replacement has joined (``elastic.Worker._boundary``). So which steps are hit, and how
many shots land, depends on the steps and the seed, not on how fast this machine starts a
process: a test's kills and rejoins happen alike on a fast and a slow machine. Without a
replacement on its way (``--no-respawn``) an injection fires at once: that is how a second
failure before the copies are back (the checkpoint fallback) is scripted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from plait.resilience.config import ResilienceConfig


@dataclass
class Shot:
    worker: int
    signal: str  # "kill" | "stop"
    at: float  # monotonic time to fire
    step: int


@dataclass
class Chaos:
    cfg: ResilienceConfig
    rng: random.Random = field(init=False)
    pending: list = field(default_factory=list)  # injections not fired yet
    next_step: int = 0  # --chaos-every: the step at which the next random kill is due
    armed: list = field(default_factory=list)  # Shots waiting for their time
    steps: int = 0  # the run's last step: no random kill is due at it (the run ends first)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.cfg.chaos_seed)
        self.pending = sorted(self.cfg.inject_failure, key=lambda i: (i.step, i.worker))
        self.next_step = self.cfg.chaos_every

    @property
    def enabled(self) -> bool:
        return bool(self.pending or self.cfg.chaos_every or self.armed)

    def _before_end(self, step: int) -> bool:
        return not self.steps or step < self.steps

    def _waiting(self, copies: int, coming: bool) -> bool:
        """Whether shots wait for a replacement (and the run with them)."""
        return coming and copies <= self.cfg.fault_tolerance

    def next_due(self) -> int:
        """The step at which the next shot falls due (0: none left)."""
        due = [i.step for i in self.pending]
        if self.cfg.chaos_every and self._before_end(self.next_step):
            due.append(self.next_step)
        return min(due, default=0)

    def hold_step(self, *, copies: int, coming: bool) -> int:
        """The step before which the run holds (``ft/hold``; 0: nowhere): the next shot's,
        while it waits for a replacement."""
        return self.next_due() if self._waiting(copies, coming) else 0

    def tick(
        self,
        progress: dict[int, tuple],
        members,
        now: float,
        *,
        copies: int = 0,
        coming: bool = False,
    ) -> list[Shot]:
        """Shots to fire now. ``progress``: worker -> (step it runs, when it started it,
        its previous step's duration, "step" or "save"), from the store; ``members``:
        workers training; ``copies``: replicas of the generation whose workers all train;
        ``coming``: a replacement is on its way. Injections of one step share one delay:
        they land together. A random kill (``--chaos-every``) waits while the run holds F
        copies or fewer, so that each is survivable in place; an injection waits only while
        a replacement is also on its way (module docstring)."""
        delays: dict[int, float] = {}
        for inj in list(self.pending):
            seen = progress.get(inj.worker)
            if seen is None or inj.worker not in members or seen[0] < inj.step:
                continue
            if self._waiting(copies, coming):
                continue  # the run holds for the replacement; then it fires
            if inj.signal == "save":
                if seen[0] == inj.step and seen[3] != "save":
                    continue  # not writing it yet
                self.pending.remove(inj)
                self.armed.append(Shot(inj.worker, "kill", now, inj.step))
                continue
            self.pending.remove(inj)
            if inj.step not in delays:
                delays[inj.step] = self.rng.uniform(0.0, max(seen[2], 0.0))
            self.armed.append(Shot(inj.worker, inj.signal, now + delays[inj.step], inj.step))
        random_ok = not self.armed and copies > self.cfg.fault_tolerance  # one at a time
        if self.cfg.chaos_every and members and progress and random_ok:
            running = max(p[0] for w, p in progress.items() if w in members)
            if running >= self.next_step and self._before_end(running):
                victim = self.rng.choice(sorted(members))
                self.next_step = running + self.cfg.chaos_every
                last = progress[victim][2] if victim in progress else 0.0
                delay = self.rng.uniform(0.0, max(last, 0.0))
                self.armed.append(Shot(victim, self.cfg.chaos_signal, now + delay, running))
        fire = [s for s in self.armed if s.at <= now]
        self.armed = [s for s in self.armed if s.at > now]
        return fire
