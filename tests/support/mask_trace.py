"""A trace of the pipelined engine's host-side events while it runs constrained (json) sequences,
and the property every family's json test checks on it: no launch waits for a mask (engine/
scheduler.py: masks one step behind). Shared by the Qwen and Florence-2 json tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchvlm.engine.engine import Engine


@dataclass
class MaskTrace:
    """Launches, collects (the host's only wait for the device), mask computations (each in the
    schedule of a step) and the schedules that found nothing to run; the rows of each step and the
    masked rows of each step."""

    events: list[tuple[str, int]] = field(default_factory=list)
    rows: dict[int, set[int]] = field(default_factory=dict)
    masked: dict[int, set[int]] = field(default_factory=dict)

    @classmethod
    def attach(cls, engine: Engine) -> MaskTrace:
        """Wraps the engine's runner and scheduler so that its next run is traced."""
        trace = cls()
        runner, sched = engine.runner, engine.scheduler
        events = trace.events

        def launch(plan, launch=runner.launch):
            events.append(("launch", plan.step))
            trace.rows[plan.step] = set(plan.new_rows.tolist()) | set(plan.decode_rows.tolist())
            trace.masked[plan.step] = set(plan.mask_rows.tolist())
            return launch(plan)

        def collect(inflight, collect=runner.collect):
            events.append(("collect", inflight.plan.step))
            return collect(inflight)

        def fill_masks(answers, out, fill=sched.fill_masks):
            events.append(("mask", sched.step))
            fill(answers, out)

        def schedule(schedule=sched.schedule):
            plan = schedule()
            if plan is None and sched.running:
                assert all(s.inflight > 0 for s in sched.running if s.state.name == "RUNNING")
                events.append(("nothing to run", sched.step))
            return plan

        runner.launch, runner.collect, sched.fill_masks, sched.schedule = launch, collect, fill_masks, schedule
        return trace

    def assert_no_launch_waits_for_a_mask(self) -> None:
        """Pipelined: the masks of step t are computed after step t-1 was launched and before it is
        collected, from tokens of committed steps only; the device waits for the host only when
        nothing at all could run (every running sequence's last step in flight)."""
        events = self.events
        overlapped = 0
        for k, (what, t) in enumerate(events):
            if what != "mask" or t == 0:
                continue
            assert [e for e in events[:k] if e[0] == "launch"][-1] == ("launch", t - 1)
            if ("collect", t - 1) in events[:k]:  # the device ran dry: nothing else was runnable
                assert ("nothing to run", t) in events[events.index(("launch", t - 1)):k]
            else:  # computed while step t-1 runs: for rows not in it, whose tokens are all committed
                overlapped += 1
                assert not self.masked[t] & self.rows[t - 1]
        waits = sum(e[0] == "nothing to run" for e in events)
        steps = sum(e[0] == "launch" for e in events)
        # Constrained rows take turns in two cohorts: the device runs dry only at the start (every
        # sequence admitted at once) and in the tail (one answer left, nothing to overlap it with).
        assert overlapped > waits and overlapped > steps // 2, (overlapped, waits, steps)
