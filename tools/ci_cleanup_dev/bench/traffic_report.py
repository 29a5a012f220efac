"""The figures of ``bench --traffic`` (:mod:`ci_cleanup_dev.bench.traffic`) and its section of BENCHMARKS.md: per job
and contender the workload's p99 against its round's alone window, its share of slowed transactions, the longest lock
wait the job caused and the job's rows a second; the step test; and issue 70's targets, met or not."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..batches import JOBS
from .server import machine, postgres_settings

HEADING = "## GitLab's traffic: a synthetic workload beside each job"
ALONE, UNTHROTTLED, ADAPTIVE = "alone", "unthrottled", "adaptive"
DUTY_CYCLES = (0.5, 0.25)
FIXED = (UNTHROTTLED, *(f"duty {d:g}" for d in DUTY_CYCLES))  # the fixed brakes (unthrottled: duty 1)
QUIET = "no traffic: "
QUIET_UNTHROTTLED, QUIET_ADAPTIVE = QUIET + UNTHROTTLED, QUIET + ADAPTIVE
WITH_TRAFFIC = (ALONE, *FIXED, ADAPTIVE)
CONTENDERS = (*WITH_TRAFFIC, QUIET_UNTHROTTLED, QUIET_ADAPTIVE)
STEP = (("light", 0.5), ("heavy", 1.0), ("light again", 0.5))  # the step test's phases: a share of the rate each
# Issue 70's targets: the adaptive job's p99 ratio and lock waits; its pace against the best fixed duty cycle that
# keeps the ratio, and against unthrottled with no traffic.
TARGETS = {"ratio": 1.5, "lock_ms": 200, "vs_best_fixed": 0.9, "no_traffic": 0.9}


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``p`` % of the values at or below it."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


WAIT = re.compile(r"\[(\d+)\] LOG:  process \d+ (still waiting for|acquired) .+? after ([\d.]+) ms")
HOLDERS = re.compile(r"\[(\d+)\] DETAIL:  Process(?:es)? holding the lock: ([\d, ]+)\.")


def lock_waits(lines: list[str], waiters: set[int]) -> tuple[float, float]:
    """From the server's log: the longest lock wait of a backend in ``waiters``, and the longest whose holders were
    not all ``waiters`` (another session's lock: the job's). A wait still going on counts for as long as logged."""
    holders: dict[int, set[int]] = {}
    longest = by_others = 0.0
    for line in lines:
        if match := HOLDERS.search(line):
            holders[int(match[1])] = {int(p) for p in match[2].replace(" ", "").split(",") if p}
        elif (match := WAIT.search(line)) and int(match[1]) in waiters:
            ms = float(match[3])
            longest = max(longest, ms)
            if not holders.get(int(match[1]), set()) <= waiters:
                by_others = max(by_others, ms)
    return longest, by_others


@dataclass
class Sample:
    """One window: the workload's transactions scheduled inside it (latency in ms from the scheduled start), the
    job's run over it."""

    latencies_ms: list[float]
    service_p99_ms: float  # the same transactions' own BEGIN to COMMIT
    lock_ms: float  # the longest lock wait of the workload (0: none over its deadlock_timeout)
    job_lock_ms: float  # the longest whose holder was not one of the workload's own backends: the job's
    seconds: float
    rows: int = 0
    stopped: bool = True  # the window's end stopped the job; False: it ran out of candidates first
    pacing: dict = field(default_factory=dict)  # the run's pacing metadata (adaptive)

    @classmethod
    def of(cls, done: list, waits: tuple[float, float], run, rows: int | None = None) -> Sample:
        """From the workload's transactions (``Done``) inside the window and the job's ``run`` over it."""
        service = percentile([d.service * 1000 for d in done], 99) if done else 0.0
        return cls([round(d.latency * 1000, 3) for d in done], round(service, 3), *waits, run.end - run.start,
                   run.rows if rows is None else rows, run.stopped, run.pacing)

    @property
    def transactions(self) -> int:
        return len(self.latencies_ms)

    def p(self, pct: float) -> float:
        return percentile(self.latencies_ms, pct)

    def slow_share(self, threshold_ms: float) -> float:
        return sum(ms > threshold_ms for ms in self.latencies_ms) / len(self.latencies_ms)

    @property
    def summary(self) -> str:
        traffic = (f"; workload {self.transactions} transactions, p50 {self.p(50):.1f} p99 {self.p(99):.1f} ms "
                   f"(BEGIN to COMMIT p99 {self.service_p99_ms:.1f}), lock wait {self.lock_ms:.0f} ms "
                   f"({self.job_lock_ms:.0f} by the job)" if self.latencies_ms else "")
        paced = f"; paused {self.pacing.get('pacing_paused_share', 0):.0%}" if self.pacing else ""
        ran_out = "" if self.stopped else " (ran out of candidates)"
        return f"{self.rows:,} rows in {self.seconds:.2f} s{ran_out}{traffic}{paced}"


@dataclass
class JobTraffic:
    job: str
    candidates: int
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {c: [] for c in CONTENDERS})
    step: dict[str, Sample] = field(default_factory=dict)
    step_candidates: int = 0
    changed_share: float = 1.0  # of the candidates, those the job changes (its guards spare the others)
    load: list[float] = field(default_factory=list)  # the 1-minute load average before and after its rounds
    rows: int = 0  # ci_builds / ci_job_artifacts rows before the candidates

    @classmethod
    def from_dict(cls, stored: dict) -> JobTraffic:
        samples = {c: [Sample(**s) for s in stored["samples"][c]] for c in CONTENDERS}
        step = {name: Sample(**s) for name, s in stored["step"].items()}
        return cls(stored["job"], stored["candidates"], samples, step, stored["step_candidates"],
                   stored["changed_share"], stored["load"], stored["rows"])

    def _paired(self, contender: str, figure: Callable[[Sample, Sample], float]) -> float:
        """The median over the rounds of ``figure`` of each round's window and the same round's alone window."""
        return statistics.median(figure(s, alone) for s, alone in
                                 zip(self.samples[contender], self.samples[ALONE], strict=True))

    def ratio(self, contender: str) -> float:
        return self._paired(contender, lambda s, alone: s.p(99) / alone.p(99))

    def slow_share(self, contender: str) -> float:
        """The share of the workload's transactions slower than the ratio target times its round's alone p99."""
        return self._paired(contender, lambda s, alone: s.slow_share(TARGETS["ratio"] * alone.p(99)))

    def job_lock_ms(self, contender: str) -> float:
        """The longest lock wait the job caused, over every round (the worst, not a median)."""
        return max(s.job_lock_ms for s in self.samples[contender])

    def rows_per_s(self, contender: str) -> float:
        return statistics.median(s.rows / s.seconds for s in self.samples[contender])

    def ran_out(self, contender: str) -> bool:
        return not all(s.stopped for s in self.samples[contender])

    def paused_share(self, contender: str) -> float:
        return statistics.median(s.pacing.get("pacing_paused_share", 0.0) for s in self.samples[contender])

    def slowed_by(self, contender: str) -> Counter:
        """How often each signal slowed the job, over every round."""
        return sum((Counter(s.pacing.get("pacing_slowed_by", {})) for s in self.samples[contender]), Counter())

    def best_fixed(self) -> str | None:
        """The fixed duty cycle (unthrottled among them) that drains fastest while keeping the ratio target."""
        keeping = [c for c in FIXED if self.ratio(c) <= TARGETS["ratio"]]
        return max(keeping, key=self.rows_per_s, default=None)

    def vs_best_fixed(self) -> float | None:
        best = self.best_fixed()
        return None if best is None else self.rows_per_s(ADAPTIVE) / self.rows_per_s(best)

    def no_traffic(self) -> float:
        """The adaptive job's rows a second over the unthrottled job's with no traffic, each round's own pair."""
        return statistics.median(a.rows / a.seconds / (u.rows / u.seconds) for a, u in
                                 zip(self.samples[QUIET_ADAPTIVE], self.samples[QUIET_UNTHROTTLED], strict=True))

    def step_rows_per_s(self, *phases: str) -> float:
        return sum(self.step[p].rows for p in phases) / sum(self.step[p].seconds for p in phases)

    def light_over_heavy(self) -> float:
        """The step test's rows a second while the traffic is light (both light phases) over while it is heavy."""
        heavy = self.step_rows_per_s(STEP[1][0])
        return self.step_rows_per_s(STEP[0][0], STEP[2][0]) / heavy if heavy else math.inf

    def met(self) -> dict[str, bool | None]:
        """Each target, met or not (None: nothing to compare with)."""
        vs_best = self.vs_best_fixed()
        return {"ratio": self.ratio(ADAPTIVE) <= TARGETS["ratio"],
                "lock_ms": self.job_lock_ms(ADAPTIVE) <= TARGETS["lock_ms"],
                "vs_best_fixed": None if vs_best is None else vs_best >= TARGETS["vs_best_fixed"],
                "step": self.light_over_heavy() > 1 if all(s.stopped for s in self.step.values()) else None,
                "no_traffic": self.no_traffic() >= TARGETS["no_traffic"]}


def _verdict(met: bool | None, unknown: str = "") -> str:
    return {True: "met", False: "**not met**", None: unknown}[met]


def contenders_table(results: list[JobTraffic]) -> str:
    head = ("| job | run | transactions (least of the rounds) | p50 / p99 ms | p99 ratio | slower than 1.5 × alone p99 "
            "| longest lock wait the job caused, ms | rows/s | adaptive: paused share; slowed by |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        for c in CONTENDERS:
            ss = r.samples[c]
            traffic = c != ALONE and not c.startswith(QUIET)
            p50, p99 = (statistics.median(s.p(q) for s in ss) for q in (50, 99)) if ss[0].latencies_ms else (0, 0)
            cells = [r.job, c, f"{min(s.transactions for s in ss):,}" if ss[0].latencies_ms else "",
                     f"{p50:.1f} / {p99:.1f}" if ss[0].latencies_ms else "",
                     f"{r.ratio(c):.2f}" if traffic else "", f"{r.slow_share(c):.1%}" if traffic else "",
                     f"{r.job_lock_ms(c):.0f}" if traffic else "",
                     "" if c == ALONE else f"{r.rows_per_s(c):,.0f}{' (ran out)' if r.ran_out(c) else ''}",
                     _pacing(r, c) if c.endswith(ADAPTIVE) else ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pacing(r: JobTraffic, contender: str) -> str:
    slowed = ", ".join(f"{signal} {n}" for signal, n in r.slowed_by(contender).most_common()) or "nothing"
    return f"{r.paused_share(contender):.0%}; {slowed}"


def step_table(results: list[JobTraffic], rate: float) -> str:
    head = ("| job | phase | workload tx/s | transactions | p50 / p99 ms | rows/s "
            "| longest lock wait the job caused, ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        for name, share in STEP:
            s = r.step[name]
            lines.append(f"| {r.job} | {name} | {rate * share:g} | {s.transactions:,} | {s.p(50):.1f} / "
                         f"{s.p(99):.1f} | {s.rows / s.seconds:,.0f}{'' if s.stopped else ' (ran out)'} "
                         f"| {s.job_lock_ms:.0f} |")
    return "\n".join(lines)


def targets_table(results: list[JobTraffic]) -> str:
    head = ("| job | adaptive p99 ratio (≤ 1.5) | its longest lock wait ms (≤ 200) "
            "| best fixed duty cycle keeping ≤ 1.5 | adaptive rows/s over it (≥ 0.9) "
            "| step: rows/s light / heavy (light faster) | no traffic: adaptive over unthrottled rows/s (≥ 0.9) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        met, best, vs = r.met(), r.best_fixed(), r.vs_best_fixed()
        light, heavy = r.step_rows_per_s(STEP[0][0], STEP[2][0]), r.step_rows_per_s(STEP[1][0])
        lines.append(
            f"| {r.job} | {r.ratio(ADAPTIVE):.2f}: {_verdict(met['ratio'])} "
            f"| {r.job_lock_ms(ADAPTIVE):.0f}: {_verdict(met['lock_ms'])} "
            f"| {f'{best}, {r.rows_per_s(best):,.0f} rows/s' if best else 'none'} "
            f"| {f'{vs:.2f}: ' if vs is not None else ''}{_verdict(met['vs_best_fixed'], 'none to compare')} "
            f"| {light:,.0f} / {heavy:,.0f}: {_verdict(met['step'], 'not measured (ran out of candidates)')} "
            f"| {r.no_traffic():.2f}: {_verdict(met['no_traffic'])} |")
    return "\n".join(lines)


def figure_lines(results: list[JobTraffic]) -> str:
    """The worst job's figure per target, then per job which targets it met."""
    compared = [v for r in results if (v := r.vs_best_fixed()) is not None]
    lines = [f"adaptive_p99_ratio_max={max(r.ratio(ADAPTIVE) for r in results):.2f}",
             f"adaptive_job_lock_wait_ms_max={max(r.job_lock_ms(ADAPTIVE) for r in results):.0f}",
             f"adaptive_vs_best_fixed_min={min(compared):.2f}" if compared else "adaptive_vs_best_fixed_min=none",
             f"step_light_over_heavy_min={min(r.light_over_heavy() for r in results):.2f}",
             f"no_traffic_adaptive_vs_unthrottled_min={min(r.no_traffic() for r in results):.2f}",
             f"unthrottled_p99_ratio_max={max(r.ratio(UNTHROTTLED) for r in results):.2f}"]
    for r in results:
        met = r.met()
        lines.append(f"targets_met_{r.job}=" + ",".join(k for k, v in met.items() if v) + (
            f" (not met: {','.join(k for k, v in met.items() if v is False)})" if False in met.values() else "") + (
            f" (not measured: {','.join(k for k, v in met.items() if v is None)})" if None in met.values() else ""))
    return "\n".join(lines)


def section(results: list[JobTraffic], *, rate: float, window_s: float, context: str) -> str:
    rounds = min(len(r.samples[ALONE]) for r in results)
    return f"""{HEADING}

{context}

A synthetic GitLab workload (`tools/ci_cleanup_dev/bench/workload.py`, a process of its own on 6 connections) at
{rate:g} transactions/s: 40 % a runner's update of its build by id (`lock_version + 1`, as optimistic locking writes
it), 20 % an artifact inserted for a new job, 40 % reads by id of builds and artifacts; a fifth of the updates and
reads on the job's own candidate rows (updates where those are builds). Open loop: each transaction has a scheduled
start at the fixed rate and the connections take them in turn, and its latency counts from that scheduled start, so
a generator that falls behind (its connections held up, or its process short of CPU) shows as latency.
`ci_builds` and `ci_job_artifacts` at {max(r.rows for r in results):,} rows before the candidates (the other tables
a tenth), each job's candidates added on top. Per job, {rounds} rounds; in each, every window starts from the same
reset state (the launched-jobs section's) with the job's connections open and used, in an order that changes
between rounds:

- "alone": the workload with no job. "unthrottled", "duty 0.5", "duty 0.25": the job's service in this process
  (as its process op runs it; schedule_bulk_delete_job_artifacts' 10 bucket workers at once, the high-concurrency
  flag on), with the brake its first op builds for `throttle: off` and that duty cycle (unthrottled: 1).
  "adaptive": the same with no setting, the job's default (`RunOptions().brake()`, the signals read by
  `ci_cleanup.batch.paced` on the job's table, one pacer for all ten bucket workers). "no traffic: …": unthrottled
  and adaptive without the workload, a pair each round (one window's rate moves too much between runs to judge
  0.9 on). The launched job (`dagster job execute`) of this section's earlier version is left out: its window
  could not be ended on time (a launched run has no stop but being terminated) and its start-up is measured in the
  launched-jobs section; every contender here shares one client.
- Each window lasts {window_s:.1f} s, at least 1,000 of the workload's transactions; the job is told to stop at
  its end (`Hooks.stop` for the bucket workers, the others after the batch that ends past it), and the window is
  its run, start to stop. Candidates enough for the unthrottled job to outlast it; "(ran out)" where a job did
  not.
- Latencies of the transactions scheduled inside the window; p50, p99 and rows/s the median of the rounds';
  "p99 ratio" each round's p99 over the same round's alone p99, the median of the rounds'; "slower than 1.5 ×
  alone p99" the share of the window's transactions, the median of the rounds'.
- Lock waits: the workload's sessions set `log_lock_waits` and `deadlock_timeout = 5ms`, so each of their waits
  longer than that is logged with the lock's holder; the job's are those whose holder is not the workload's own
  backend; the longest over every round (0: none over 5 ms).
- Adaptive: the share of the run's time paused and the signals that slowed it (batches slowed, over the rounds),
  from the run's pacing metadata.
- The step test, per job after its rounds: one run at the adaptive default while the workload runs at half its
  rate, then the full rate, then half again, each phase long enough for 1,000 transactions (candidates added so
  that the job outlasts it at its rounds' pace); rows/s of the batches that ended in each phase.

{contenders_table(results)}

The step test:

{step_table(results, rate)}

Issue 70's targets, per job:

{targets_table(results)}

{figure_lines(results)}
"""


def with_section(markdown: str, text_: str) -> str:
    """BENCHMARKS.md with this section (up to the next one) replaced by ``text_``, or ``text_`` added at its end."""
    before, found, after = markdown.partition(HEADING)
    if not found:
        return markdown.rstrip("\n") + "\n\n" + text_
    rest = after.split("\n## ", 1)
    return before + text_ + ("\n## " + rest[1] if len(rest) > 1 else "")


def merged(path: Path | None, results: list[JobTraffic]) -> list[JobTraffic]:
    """``results`` with the other jobs' from an earlier run stored at ``path`` (a job measured again replaces its
    own), in the jobs' order; all of them stored back. Lets the jobs be measured one at a time, when the machine
    is quiet."""
    if path is None:
        return results
    stored = {r["job"]: JobTraffic.from_dict(r) for r in json.loads(path.read_text())} if path.is_file() else {}
    stored.update({r.job: r for r in results})
    order = [job.name for job in JOBS]
    every = sorted(stored.values(), key=lambda r: order.index(r.job))
    path.write_text(json.dumps([asdict(r) for r in every]))
    return every


def report(results: list[JobTraffic], args, env: dict[str, str], *, cpus: str, minutes: float,
           left_out: dict[str, str], window_s: float) -> None:
    """The section printed, and written into ``args.output``."""
    now = dt.datetime.now(dt.UTC)
    loads = "; ".join(f"{r.job} {r.load[0]:.2f} → {r.load[1]:.2f}" for r in results)
    missing = "; ".join(f"{job}: {why}" for job, why in left_out.items())
    context = (f"Written by `ci-cleanup bench --traffic{' --small' if args.small else ''}` on {now:%Y-%m-%d %H:%M} "
               f"UTC in {minutes:.0f} minutes: {machine()}; PostgreSQL: "
               f"{postgres_settings(env['CI_CLEANUP_DATABASE_URL'])}; {cpus}. "
               f"{results[0].candidates:,} candidates per job. The 1-minute load average before and after each job's "
               f"rounds: {loads}. Left out: {missing}.")
    text_ = section(results, rate=args.rate, window_s=window_s, context=context)
    print(text_)
    if args.output:
        path = Path(args.output)
        path.write_text(with_section(path.read_text() if path.is_file() else "# Benchmarks\n", text_))
        print(f"\nWritten to {args.output}")
