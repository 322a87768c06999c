"""How ``python -m autosp.plan`` shows a decision in progress: a bar with the time left on a terminal, a log line
per candidate elsewhere (`autosp.plan.planner.Progress` is what the planner tells)."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("autosp.plan")


class DecisionProgress:
    """A `autosp.plan.planner.Progress`: on a terminal (stderr) a tqdm bar of the candidates decided, the elapsed
    time and tqdm's estimate of the time left; elsewhere (a log file, CI) an INFO line per candidate with the
    elapsed time and the time left at the mean rate so far.  A decision that starts again (``plan_job``'s next
    DeepSpeed setup) starts a new bar.  Candidates cost unequal times (the first of a trace group traces, the others
    reuse it), so the estimate is a guide, not a promise."""

    def __init__(self, what: str = "memory plan") -> None:
        self.what = what
        self._bar: tqdm | None = None
        self._started, self._first = 0.0, 0

    def __call__(self, decided: int, total: int, name: str) -> None:
        if self._bar is None or decided < self._bar.n or total != self._bar.total:
            self.close()
            self._bar = tqdm(total=total, desc=self.what, unit="candidate", file=sys.stderr, disable=None,
                             leave=False, dynamic_ncols=True)
            self._started, self._first = time.perf_counter(), decided
        if name:
            self._bar.set_postfix_str(name, refresh=False)
        self._bar.update(decided - self._bar.n)
        if self._bar.disable and name:
            elapsed = time.perf_counter() - self._started
            rate = (decided - self._first) / elapsed if elapsed > 0 else 0.0
            left = f", about {(total - decided) / rate:.0f} s left" if rate > 0 and decided < total else ""
            log.info("%s: %d of %d candidates decided (%s), %.0f s%s", self.what, decided, total, name, elapsed,
                     left)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
