"""The grading run: one drill's tests against one tree, in a test process of its
own, summarised as a grade. Names no drill. grader.py shows what this returns;
tests/test_wrong.py grades the planted bugs through it.

- The learner's code runs in a worker process behind the tests (tests/_worker.py),
  with a time limit per test; a crash or hang there fails that test only.
- If the test process itself dies, the run goes on in a fresh one with the tests
  not yet run; the test it died in is reported as crashed.
- The report is signed with a key handed over through a pipe; lines that do not
  check are counted as forged, and the grade says so.
- A pitfall is named only on evidence (tests/_diagnose.py): the simplest failing
  case is explained first (the page's worked example, then fixed cases, then
  hypothesis's), and a crash names the pitfall of the test it happened in only
  when every crash of the run, and every other failure too, happened in a test
  marked with that pitfall; a crash in a test marked with a pitfall that other failures
  name keeps the name (a crash says nothing against it).
"""
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _env
import _wrong
from _diagnose import explain_error
from _process import SCRATCH_ROOT, WORKER_PLAN, Child, exit_name, run_process
from _report import read_signed
from _scratch import DrillScratch, remove_orphans  # noqa: F401  -- grader.py's
from _tree import ROOT, worker_trees

RESTARTS = 3       # fresh test processes after the test process itself dies


def _pytest(drills, tree, report, timeout, env, deselect, variants=None, select=None, shard=None, stall=None):
    """One test process for the drills' test files; returns its exit code (None: killed
    at the time limit, or after `stall` seconds in which its report did not grow), its
    output and the report's key."""
    key_read, key_write = os.pipe()
    key = secrets.token_bytes(32)
    os.write(key_write, key)
    os.close(key_write)
    # --tb=native: the report keeps its own account of each failure, and pytest's default
    # traceback parses the source of every frame of every failure (half the run's time
    # when many tests fail).
    cmd = [sys.executable, "-m", "pytest", *(f"tests/test_{d.stem}.py" for d in drills), f"--tree={tree}", "-q",
           "--tb=native", "-p", "no:randomly", "--drills-report", str(report), "--drills-key-fd", str(key_read)]
    if variants:
        cmd += ["--drills-variants", str(variants)]
    if select:
        cmd += ["-k", select]
    if shard:
        cmd += [f"--drills-shard={shard}"]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    if len(drills) == 1 and not variants:  # the worker its `drill` fixture will ask for, started first
        plan = dict(readable=worker_trees(tree), preload=list(drills[0].preload))
        env = {**(env or {}), WORKER_PLAN: json.dumps(plan)}
    try:
        if stall is None:
            code, out, err = run_process(cmd, timeout, env, pass_fds=(key_read,))
        else:
            code, out, err = _wait_while_progressing(Child(cmd, env, (key_read,)), report, timeout, stall)
    finally:
        os.close(key_read)
    return code, out, err, key


def _wait_while_progressing(child, report, timeout, stall):
    """Wait for a test process as long as it makes progress: it is ended once its report
    has not grown for `stall` seconds (each test writes a line when it starts and one when
    it ends, and each of the learner's calls has its own limit), or after `timeout` seconds
    in all when one is given. A busy machine then costs time, never the grading."""
    child.wait_while_moving(lambda: report.stat().st_size if report.exists() else 0, stall, timeout, every=2)
    return child.wait(0)


def shards():
    """How many test processes grade one drill at once (DRILLS_SHARDS). On a GPU most of a
    drill's grade is Triton compiling a kernel for each new specialisation its examples
    meet, one core at a time: a host with cores to spare compiles K at a time. Under the
    interpreter, one (its runs are the tests themselves, on a laptop's few cores). A shard
    is two processes (the tests and the worker), so a core each; on a 16-core H200 host
    8 shards graded L3's tests in 45 s against 59 s with 4 (BENCHMARKS.md)."""
    if os.environ.get("DRILLS_SHARDS"):
        return max(1, int(os.environ["DRILLS_SHARDS"]))
    return 1 if _env.INTERPRET else max(1, min(8, (os.cpu_count() or 1) // 2))


def run_tests(drills, tree, timeout, env=None, variants=None, select=None, count=1, stall=None):
    """Run the tests of a list of drills in one test process, resuming in a fresh one
    after the test process dies; or in `count` shards at once (tests/_plugin.py's
    --drills-shard), merged. Returns (records, problems): the report's records and what
    went wrong around them."""
    if count <= 1:
        return _run_shard(drills, tree, timeout, env, variants, select, stall=stall)
    dump = (env or {}).get("DRILLS_CASE_DUMP")
    results = [None] * count

    def one(i):
        shard_env = {**(env or {}), **({"DRILLS_CASE_DUMP": f"{dump}.{i}"} if dump else {})}
        results[i] = _run_shard(drills, tree, timeout, shard_env, variants, select, f"{i}/{count}", stall)
    threads = [threading.Thread(target=one, args=(i,), name=f"grading shard {i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    saved = [f"{dump}.{i}" for i in range(count) if dump and os.path.exists(f"{dump}.{i}")]
    for i, path in enumerate(saved):  # the picture draws the first shard's saved case
        os.replace(path, dump) if i == 0 else os.remove(path)
    return _merged([r if r is not None else ([], ["a grading shard did not finish"]) for r in results])


def _merged(results):
    """The shards' records as one run's: the collection (each shard reports all of it), then
    per test, in collection order, a failing record if any shard failed it (a hypothesis
    test runs in every shard, each with its share of the examples), else its pass, else
    its skip; each problem once."""
    collected = next((r for records, _ in results for r in records if "collected" in r), None)
    order = {test: i for i, test in enumerate(collected["collected"])} if collected else {}
    rank = {"failed": 0, "passed": 1}
    best = {}
    for records, _ in results:
        for r in records:
            if "outcome" in r and rank.get(r["outcome"], 2) < rank.get(best.get(r["test"], {}).get("outcome"), 3):
                best[r["test"]] = r
    outcomes = sorted(best.values(), key=lambda r: order.get(r["test"], len(order)))
    problems = list(dict.fromkeys(p for _, found in results for p in found))
    return ([collected] if collected else []) + outcomes, problems


def _run_shard(drills, tree, timeout, env=None, variants=None, select=None, shard=None, stall=None):
    """run_tests in one test process (or one shard, "I/K"), resumed after it dies."""
    env = {**(env or {}), "PYTHONUNBUFFERED": "1"}
    records, problems, done = [], [], []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="drills-grade-") as tmp:
        for attempt in range(RESTARTS + 1):
            report = Path(tmp) / f"report-{attempt}.jsonl"
            left = None if timeout is None else max(timeout - (time.monotonic() - started), 1)
            code, out, err, key = _pytest(drills, tree, report, left, env, done, variants, select, shard, stall)
            lines, forged = read_signed(report, key)
            if forged:
                problems.append(f"the report holds {forged} line(s) the test process did not write: something "
                                f"else wrote to it, so this grade cannot be trusted")
            records += lines
            finished = {r["test"] for r in lines if "outcome" in r}
            unfinished = [r for r in lines if "start" in r and r["start"] not in finished]
            if code is None:
                where = (unfinished[-1]["start"] if unfinished else "collecting the tests").split("::")[-1]
                problems.append(f"made no progress for {stall:.0f} s in {where}" if timeout is None
                                else f"timed out after {timeout:.0f} s in {where}")
                break
            if not any("collected" in r for r in lines):
                tail = "\n".join((err or out).strip().splitlines()[-12:])
                problems.append(f"the tests could not start (pytest exit {code}):\n{tail}")
                break
            if code in (0, 1, 5) and not unfinished:
                break
            # The test process itself died: report the test it died in, go on without it.
            dead = unfinished[-1] if unfinished else None
            how = exit_name(code)
            if dead is None:
                problems.append(f"the test process ended ({how}) with no test running")
                break
            message = f"the test process died in this test ({how})"
            meaning = explain_error(message)
            records.append(dict(test=dead["start"], name=dead["start"].split("::")[-1], outcome="failed",
                                kind="crash", variant=dead.get("variant"), pitfall_test=dead["pitfalls"],
                                message=message + (f"\n  which usually means: {meaning}" if meaning else ""),
                                pitfalls=[]))
            done += sorted(finished | {dead["start"]})
        else:
            problems.append(f"the test process died {RESTARTS + 1} times; the rest of the tests were not run")
    return records, problems


def summarize(drill, records, problems=()):
    """The grade of one drill from its test records."""
    collected = next((r["collected"] for r in reversed(records) if "collected" in r), [])
    results = {}
    for r in records:
        if "outcome" in r:
            results[r["test"]] = r
    ran = list(results.values())
    passed = sum(r["outcome"] == "passed" for r in ran)
    skipped = sum(r["outcome"] == "skipped" for r in ran)
    failures = [r for r in ran if r["outcome"] == "failed"]
    total = max(len(set(collected) | set(results)) - skipped, len(failures) + passed)
    # A pass that was only a refusal of bad input (marked `rejects`) is progress once the
    # function gets the page's worked example right: until then it is neither passed nor
    # failed, and the grade says how many there are.
    worked = [r for r in ran if "worked_example" in r["name"]]
    held = 0 if all(r["outcome"] != "failed" for r in worked) else \
        sum(r["outcome"] == "passed" and bool(r.get("rejects")) for r in ran)
    summary = dict(id=drill.id, stem=drill.stem, title=drill.title, page=drill.page, passed=passed - held,
                   failed=total - passed, skipped=skipped, total=total, problem="\n".join(problems) or None,
                   first_failure=None, diagnosis=[], rejections_not_counted=held)

    summary["timed_out"] = any(r.get("kind") == "timeout" for r in failures)
    summary["milestones"] = [line for name, line in drill.milestones.items()
                             if any(r["name"].split("[")[0] == name and r["outcome"] == "passed" for r in ran)]
    summary["left_out"] = [dict(name=r["name"], why=str(r.get("message") or "").removeprefix("Skipped: "))
                           for r in ran if r["outcome"] == "skipped"]
    real = [r for r in failures if r.get("kind") != "not_implemented"]
    ordered = sorted(real, key=_simplest_first)
    imports = next((r for r in failures if r.get("kind") == "import"), None)
    if imports:  # the file does not import (tests/_plugin.py): nothing else ran, nothing else to say
        summary.update(status="failing", passed=0, failed=total, rejections_not_counted=0, does_not_import=True,
                       problem="\n".join([imports["message"], *problems]), timed_out=False, milestones=[],
                       left_out=[], undecided=[])
        return summary
    first = (ordered or failures or [None])[0]
    if first:
        summary["first_failure"] = {k: first.get(k) for k in ("name", "kind", "message", "where", "example", "stdout",
                                                            "stderr")}
        if first.get("kind") in ("crash", "timeout") and first.get("pitfall_test"):
            marks = ", ".join(f"pitfall:{p}" for p in first["pitfall_test"])
            summary["first_failure"]["message"] += f"\n  this test exists to catch {marks} ({drill.section})"
    summary["diagnosis"] = [dict(pitfall=p, says=drill.pitfalls[p].says, section=drill.section)
                            for p in _evidence(drill, ordered) if p in drill.pitfalls]
    # Pitfalls whose planted mistake raced on a failing input (a GPU): no evidence either way.
    summary["undecided"] = sorted({p for r in ordered for p in r.get("undecided") or ()})
    if summary["failed"] == 0 and not problems:
        summary["status"] = "passed"
    elif passed == 0 and failures and not real and not problems:
        summary["status"] = "not started"
    else:
        summary["status"] = "failing"
    return summary


def _simplest_first(record):
    """The page's worked example first, then fixed cases, then hypothesis's random ones."""
    return ("worked_example" not in record["name"], bool(record.get("example")))


def _evidence(drill, ordered):
    """The pitfalls the failures single out (see the module's docstring)."""
    if not ordered:
        return []
    # The first failure's own evidence; else that of a fixed test that exists to catch the
    # pitfall it names (its marker), never a random case's.
    named = ordered[0].get("pitfalls") or next(
        ([p for p in r["pitfalls"] if p in (r.get("pitfall_test") or ())] for r in ordered
         if set(r.get("pitfalls") or ()) & set(r.get("pitfall_test") or ()) and not r.get("example")), [])
    # A name is withdrawn when a fixed test that exists to catch that pitfall failed
    # without naming it (and without being unable to tell: a racing mistake): the
    # evidence contradicts itself, so it is no evidence. A crash in such a test is no
    # contradiction: it ended before its check could say anything (a head tile stored past
    # the end of lse can abort the process in one of the tests that name it elsewhere).
    named = [p for p in named if all(p in (r.get("pitfalls") or ()) or p in (r.get("undecided") or ())
                                     for r in ordered if p in (r.get("pitfall_test") or ()) and not r.get("example")
                                     and r.get("kind") != "crash")]
    # A crash in a test marked with a crashing pitfall is evidence for it, when every crash
    # happened in such a test and every failure that ran to the end did too: a mistake
    # that shows itself elsewhere (values written past out, say) is that story, and a
    # write far enough past a buffer can crash a test marked with another pitfall.
    crashes = [r for r in ordered if r.get("kind") in ("crash", "timeout")]
    if crashes and not named:
        common = set.intersection(*(set(r.get("pitfall_test") or ()) for r in ordered))
        named = sorted(p for p in common if drill.pitfalls.get(p) and drill.pitfalls[p].crashes)
    return named


def grade_drill(drill, tree, timeout, workdir=None, test_timeout=None, env=None, select=None):
    """Grade one drill of one tree (`select`: a pytest -k expression, for the grader's
    own tests). The first small failing case is saved to <workdir>/<id>-case.pt."""
    started = time.monotonic()
    if select is None and is_untouched_stub(drill, tree):
        summary = summarize(drill, [dict(collected=[]), dict(test="stub", name="stub", outcome="failed",
                                                            kind="not_implemented", message="the untouched stub")])
        summary.update(passed=0, failed=None, total=None, untouched=True, seconds=round(time.monotonic() - started, 1))
        return summary
    env = dict(env or {})
    if workdir:
        env["DRILLS_CASE_DUMP"] = str(Path(workdir) / f"{drill.id}-case.pt")
    if test_timeout:
        env["DRILLS_TIMEOUT"] = str(test_timeout)
    # Its own scratch root unless grader.py made one for the whole drill (picture, traffic, bench too).
    scratch = None if SCRATCH_ROOT in os.environ or SCRATCH_ROOT in env else DrillScratch(drill.id, env)
    try:
        records, problems = run_tests([drill], tree, timeout, env, select=select, count=shards())
    finally:
        left = scratch.close() if scratch else []
    summary = summarize(drill, records, problems)
    if scratch:
        summary["left_behind"] = left
    summary["kernels"] = env.get("DRILLS_KERNELS") or os.environ.get("DRILLS_KERNELS") or None
    summary["seconds"] = round(time.monotonic() - started, 1)
    return summary


def is_untouched_stub(drill, tree):
    """Whether the tree's file is byte for byte the committed stub: then it is "not started"
    without a test process (every stub function raises NotImplementedError, which
    tests/test_meta.py checks), so a fresh clone's first grade takes seconds, not a minute."""
    path = Path(tree) / f"{drill.stem}.py"
    shown = subprocess.run(["git", "show", f"HEAD:mine/{drill.stem}.py"], cwd=ROOT, capture_output=True)
    return shown.returncode == 0 and path.is_file() and path.read_bytes() == shown.stdout


def grade_variants(drills, folder, stall=None):
    """Grade every planted bug in `folder` (<stem>/<name>/<stem>.py each) in one test
    process: a pitfall against the tests marked with it and the worked example, any
    other mistake against the worked example and every test marked with a pitfall.
    No budget for the whole: the process runs as long as it makes progress (`stall`,
    default PLANTED_STALL), so a busy machine slows it and never cuts it short; each
    planted call may take PLANTED_CALL_LIMIT s, since no planted bug hangs and a slow
    call must not become a verdict. Returns {(drill id, name): summary}."""
    env = {"DRILLS_HYPOTHESIS_PROFILE": "quick", "DRILLS_TIMEOUT": str(PLANTED_CALL_LIMIT)}
    records, problems = run_tests(drills, ROOT / "solutions", None, env, variants=folder,
                                  stall=stall or PLANTED_STALL)
    collected = [(t, v) for r in records if "collected" in r for t, v in zip(r["collected"], r["variants"])]
    grades = {}
    for drill in drills:
        ours = f"tests/test_{drill.stem}.py::"
        for name in sorted(p.name for p in (Path(folder) / drill.stem).iterdir() if p.is_dir()):
            mine = [r for r in records if "outcome" in r and r.get("variant") == name and r["test"].startswith(ours)]
            tests = [t for t, v in collected if v == name and t.startswith(ours)]
            grades[drill.id, name] = summarize(drill, [dict(collected=tests)] + mine, problems)
    return grades


_GRADING = {}  # the grading of every planted bug, once started: thread, then result or error
PLANTED_CALL_LIMIT = 300  # seconds a planted bug's call may take (the learner's default is 60)
PLANTED_STALL = 2 * PLANTED_CALL_LIMIT + 120  # seconds the planted-bug grading may go without finishing a test


def start_grading(drills):
    """Plant every pitfall and mistake of `drills` and grade them all in one test process
    (grade_variants), from a thread: the call returns at once, and the test session
    goes on with its other tests on the other core meanwhile. `graded` waits for it."""
    if _GRADING:
        return
    folder = _wrong.folder() / "graded"
    for drill in drills:
        for name in (*[p for p, pitfall in drill.pitfalls.items() if pitfall.applies(_env.INTERPRET)],
                     *drill.mistakes):
            _wrong.plant(drill, name, folder / drill.stem / name)

    def grade():
        try:
            _GRADING["result"] = grade_variants(drills, folder)
        except BaseException as error:  # handed to whoever waits for the result
            _GRADING["error"] = error
    # A daemon thread: a session that ends early (pytest -x) does not wait for it, and
    # the test process it started dies with this one (its parent-death signal).
    _GRADING["thread"] = threading.Thread(target=grade, name="planted-bug grading", daemon=True)
    _GRADING["thread"].start()


def graded(drills):
    """{(drill id, name): summary} of every planted bug of `drills`, once graded."""
    start_grading(drills)
    _GRADING["thread"].join()
    if "error" in _GRADING:
        raise _GRADING["error"]
    return _GRADING["result"]
