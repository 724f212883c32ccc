"""Where the engine thread's time goes, per step (a profile the server keeps all the time).

Phases of one step, from `time.perf_counter()` stamps in the engine thread:
- plan: scheduling under the lock;
- model: building the step's inputs and launching it (an eager step runs its whole forward here);
- wait: until the step's token ids are on the host, i.e. the device's remaining work;
- sample_deliver: sampling what needs the host, stop checks, the hand-off to the event loop.
With the overlap scheduler a step is launched while the previous one runs, so phases of
consecutive steps overlap; the decode totals therefore count a step's share of the engine's time
as the span from its planning (or the previous step's end, if later) to its hand-off, over steps
whose every chunk is one decode token: the engine's own decode speed, with no HTTP in it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PHASES = ("plan", "model", "wait", "sample_deliver")
TIMING_LOG_STEPS = 256  # at debug level, the means are logged every this many steps


class StepTimer:
    def __init__(self) -> None:
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.decode_steps = 0
        self.decode_tokens = 0
        self.decode_step_s = 0.0  # plan through hand-off, as a share of the engine's time
        self.decode_model_s = 0.0  # model launch + the wait for its token ids
        self._last_done = 0.0  # when the last completed step handed off its outputs

    def record(self, stamps: tuple[float, float, float, float, float], decode_tokens: int | None) -> None:
        """stamps: planning began, launch began, launch returned, token ids read, hand-off done;
        decode_tokens: the step's tokens when every chunk was one decode token, else None."""
        t0, t1, t2, t3, t4 = stamps
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.phase_s[phase] += max(dt, 0.0)
        self.steps += 1
        span = t4 - max(t0, self._last_done)
        self._last_done = t4
        if decode_tokens is not None:
            self.decode_steps += 1
            self.decode_tokens += decode_tokens
            self.decode_step_s += span
            self.decode_model_s += t3 - t1
        if self.steps % TIMING_LOG_STEPS == 0 and log.isEnabledFor(logging.DEBUG):
            log.debug("engine step timing (mean over %d steps): %s", self.steps, self.means())

    def means(self) -> dict[str, float]:
        """Mean seconds per step of each phase over the steps so far, and the step count."""
        n = self.steps
        out = {f"{phase}_s": (total / n if n else 0.0) for phase, total in self.phase_s.items()}
        out["steps"] = float(n)
        return out
