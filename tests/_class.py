"""A class in one command: `grader.py class ROSTER` grades every learner of a roster with the
single grade as it is, several at once, and writes a gradebook, each learner's grade and
feedback, Gradescope's results.json and a copy-detection report. Names no drill (their ids
and stems come from tests/_catalog.py). It changes no verdict: each learner is one run of
`grader.py --tree ... --json ...`, the boundary and all.

- ROSTER holds one folder per learner: a tree of module files, or a clone of the project
  whose mine/ is used. Each learner's graded files (the selected drills' modules, regular
  files only) are copied into a private folder of their own, and that copy is graded: the
  worker's readable set is that folder alone (tests/_tree.py's worker_trees), never the
  roster, another learner's copy or OUT; odd folder names never reach a command line.
- OUT is written here, by the class process, never by a grade's worker: each grade writes
  its --json to its own private folder and this process reads it as data.
- Resumable: a learner whose graded files, selected drills and the project's machinery
  (tests/, grader.py, the stubs) hash as at their last grade is not graded again. Each
  learner's files and the gradebook are written as soon as that learner is done, so
  Ctrl-C keeps what is done.
- Bad input (no tree, extra files, a name like an option or holding a newline or '..', two
  names alike once normalised, an unreadable folder, a grade that crashes or times out) is one
  line in the terminal and the gradebook; the class goes on.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

import _catalog
import _similarity
from _commands import surely_no_gpu
from _gradebook import POINTS, Book, feedback, summary_line
from _process import _CHILDREN, Child, kill_group, kill_leftovers
from _render import clean_text, cleaned, make_console
from _tree import ROOT

FRONT = ROOT / "grader.py"
MAX_FILE = 1 << 20     # a module file larger than this is not graded (1 MiB)
RESERVED = {"gradebook", "similarity", "state"}  # the class's own outputs


def normalise(name):
    """The learner's name as the outputs use it: NFKC, casefolded, runs of anything but
    letters, digits, '.', '_' and '-' made one '-', no leading or trailing punctuation."""
    return re.sub(r"[^a-z0-9._-]+", "-", unicodedata.normalize("NFKC", name).casefold()).strip("-._")


def shown(name):  # a name as a line shows it
    return name if name.isprintable() else ascii(name)


def stub(stem):
    """The committed stub of a drill (the base every learner starts from), as bytes."""
    found = subprocess.run(["git", "show", f"HEAD:mine/{stem}.py"], cwd=ROOT, capture_output=True)
    return found.stdout if found.returncode == 0 else (ROOT / "mine" / f"{stem}.py").read_bytes()


def machinery_digest(stubs):
    """One hash of what grades a learner: tests/ (every file), grader.py, pyproject.toml,
    Makefile, and the stubs the grade compares with."""
    h = hashlib.sha256()
    files = [p for p in (ROOT / "tests").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(files) + [ROOT / n for n in ("grader.py", "pyproject.toml", "Makefile")]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    for stem in sorted(stubs):
        h.update(stem.encode() + b"\0" + stubs[stem] + b"\0")
    return h.hexdigest()


# --- the roster ---------------------------------------------------------------------------

def roster(folder, drills, stems_all):
    """[learner dict]: name (as shown), slug (as the outputs name it), folder, and either
    `tree` and `files` ({stem: bytes} of the selected drills) or `problem` (one line);
    `notes` are lines that do not stop the grade."""
    learners = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name == ".git" or entry.name.startswith(".") and not entry.is_dir():  # .DS_Store: no learner
            continue
        one = dict(name=shown(entry.name), slug=normalise(entry.name), folder=entry.path, notes=[], problem=None)
        one["problem"] = _name_problem(entry)
        if not one["problem"]:
            _find_tree(one, drills, stems_all)
        if not one["problem"] and one["slug"] != entry.name:
            one["notes"].append(f"graded as {one['slug']!r} (the folder's name, normalised)")
        learners.append(one)
    by_slug = {}
    for one in learners:
        by_slug.setdefault(one["slug"], []).append(one)
    for slug, same in by_slug.items():
        if len(same) > 1 and slug:
            for one in same:
                others = ", ".join(o["name"] for o in same if o is not one)
                one["problem"] = one["problem"] or f"the same name as {others} once normalised ({slug!r}): rename one"
                one["notes"] = []
    return learners


def _name_problem(entry):
    name, slug = entry.name, normalise(entry.name)
    bad = next((why for wrong, why in ((not name.isprintable(), "its name holds a newline or another control character"),
                                       (name.startswith("-"), "its name starts with '-' and would read as an option"),
                                       (name.startswith("."), "a hidden folder (its name starts with '.')"),
                                       (".." in name, "its name holds '..'"), (not slug, "its name has no letter or digit"),
                                       (slug in RESERVED, f"its name is that of the class's own output {slug!r}"))
                if wrong), None)
    if bad:
        return bad + ": rename the folder"
    if entry.is_symlink():
        return "a link, not a folder: copy the learner's folder into the roster"
    if not entry.is_dir():
        return "a file, not a folder: each learner is a folder of the roster"
    return None


def _find_tree(one, drills, stems_all):
    """The learner's tree (a clone's mine/, else the folder itself) and its graded files."""
    folder = Path(one["folder"])
    try:
        clone = (folder / "mine").is_dir() and not (folder / "mine").is_symlink()
        tree = folder / "mine" if clone else folder
        names = sorted(os.listdir(tree))
    except OSError as error:
        one["problem"] = f"unreadable: {error.strerror or error}"
        return
    modules = {f"{stem}.py" for stem in stems_all}
    if not clone and not modules & set(names):
        one["problem"] = ("holds no tree: neither a clone's mine/ nor a drill's module file "
                          f"(such as {sorted(modules)[0]})")
        return
    one["tree"], one["files"], one["missing"] = str(tree), {}, set()
    extra = [n for n in names if n not in modules and n != "__pycache__"]
    if extra:
        one["notes"].append(f"extra files, not graded: {', '.join(shown(n) for n in extra[:5])}"
                            + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""))
    for drill in drills:
        path = tree / f"{drill.stem}.py"
        try:
            info = os.lstat(path)
            if not path.is_file() or path.is_symlink():
                raise ValueError("a link or not a plain file")
            if info.st_size > MAX_FILE:
                raise ValueError(f"{info.st_size} bytes, over {MAX_FILE}")
            one["files"][drill.stem] = path.read_bytes()
        except FileNotFoundError:
            one["missing"].add(drill.stem)
            one["notes"].append(f"{drill.stem}.py missing: graded as the untouched stub")
        except (OSError, ValueError) as error:
            one["missing"].add(drill.stem)
            one["notes"].append(f"{drill.stem}.py not graded ({getattr(error, 'strerror', None) or error}): "
                                f"graded as the untouched stub")


def grade_key(one, drills, machinery, options):
    h = hashlib.sha256(json.dumps([machinery, [d.id for d in drills], options]).encode())
    for stem in sorted(one["files"]):
        h.update(stem.encode() + b"\0" + hashlib.sha256(one["files"][stem]).digest())
    return h.hexdigest()


# --- grading ------------------------------------------------------------------------------

class ClassRun:
    """One run of the class: the learners graded `jobs` at a time, each in a thread that
    waits on its own `grader.py` process; outputs written under one lock."""

    def __init__(self, args, drills, console, learners):
        self.args, self.drills, self.console, self.learners = args, drills, console, learners
        # Where no NVIDIA device file exists, no torch is imported to learn that kernels run on the CPU.
        self.gpu = not surely_no_gpu() and not __import__("_env").INTERPRET
        self.out = Path(args.out)
        self.stubs = {d.stem: stub(d.stem) for d in drills}
        self.options = dict(timeout=args.timeout, test_timeout=args.test_timeout, bench=self.benching(),
                            kernels=os.environ.get("DRILLS_KERNELS"))
        self.machinery = machinery_digest(self.stubs)
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.rows, self.done, self.progress, self.task, self.unbenched = {}, {}, None, None, {}
        self.book = Book(drills, args.points, args.partial)
        try:  # what the last run graded (a state that does not read: everyone is graded again)
            self.state = json.loads((self.out / "state.json").read_text())
        except (OSError, ValueError):
            self.state = {}
        self.work = tempfile.mkdtemp(prefix="drills-class-")  # the private copies, removed at the end
        os.chmod(self.work, 0o711)  # a worker that drops its uid can reach its own copy, list none

    def benching(self):
        return self.gpu and not self.args.no_bench

    def grade(self, i, one):
        key = grade_key(one, self.drills, self.machinery, self.options)
        before = self.state.get(one["slug"])
        if before and before.get("key") == key and (self.out / f"{one['slug']}.json").is_file():
            with self.lock:
                self.rows[i] = dict(before["row"], note="; ".join(one["notes"] + ["unchanged since the last run: kept"]))
                self.done[i] = "kept"
            self._advance(len(self.drills))
            self._say(one, "unchanged since the last run: kept")
            return
        tree = Path(self.work) / str(i) / "tree"
        tree.mkdir(parents=True)
        os.chmod(tree.parent, 0o711)
        for drill in self.drills:
            (tree / f"{drill.stem}.py").write_bytes(one["files"].get(drill.stem, self.stubs[drill.stem]))
        report = tree.parent / "grade.json"
        cmd = [sys.executable, str(FRONT), *[d.id for d in self.drills], "--tree", str(tree), "--json", str(report),
               "--timeout", str(self.args.timeout), "--no-bench",  # benches: after all the tests
               *(["--test-timeout", str(self.args.test_timeout)] if self.args.test_timeout else [])]
        shards = max(1, (os.cpu_count() or 2) // 2 // self.args.jobs)  # on a GPU: the host's cores shared by the jobs
        env = {} if not self.gpu or os.environ.get("DRILLS_SHARDS") else {"DRILLS_SHARDS": str(shards)}
        limit = self.args.learner_timeout or self.args.timeout * len(self.drills) + 120
        started, counted = time.monotonic(), 0
        child = Child(cmd, env=env)
        rows = re.compile(r"^(%s) " % "|".join(re.escape(d.id.upper()) for d in self.drills), re.M)
        while child.proc.poll() is None and not self.stopping.is_set() and time.monotonic() - started < limit:
            time.sleep(0.2)
            seen = len(set(rows.findall(os.pread(child.out.fileno(), 1 << 20, 0).decode(errors="replace"))))
            self._advance(seen - counted)
            counted = seen
        code, _, err = child.wait(0.5)
        kill_leftovers()  # what the grade left behind (it ends its own; this is the last sweep)
        seconds = round(time.monotonic() - started, 1)
        if self.stopping.is_set():
            return
        self._advance(len(self.drills) - counted)
        grade, problem = None, None
        if code is None:
            status, problem = "timed out", f"the grade ran past {limit:.0f} s and was ended"
        else:
            try:
                # The private copy's path (a random name, in tree, tree_name and the messages) reads as the learner's.
                text = report.read_text().replace(json.dumps(str(tree))[1:-1], json.dumps(one["tree"])[1:-1])
                grade = json.loads(text) if code in (0, 1) else None
            except (OSError, ValueError):
                grade = None
            tail = clean_text(err.strip().splitlines()[-1]) if err.strip() else "no message"
            status = "graded" if grade else "crashed"
            problem = None if grade else f"the grade ended with exit code {code}: {tail}"
        self.record(i, one, key, status, grade, problem, seconds)

    def record(self, i, one, key, status, grade, problem, seconds, final=False):
        with self.lock:
            if self.stopping.is_set():
                return
            if grade:
                self._write(f"{one['slug']}.json", json.dumps(grade, indent=2) + "\n")
                self._write(f"{one['slug']}.md", feedback(one["slug"], one["tree"], grade))
            self._write(f"{one['slug']}/results.json", json.dumps(self.book.gradescope(grade, problem), indent=2) + "\n")
            self.rows[i] = self.book.row(one, status, grade, problem, seconds)
            self.done[i] = status
            if status == "graded" and self.benching() and not final:
                self.unbenched[i] = (one, key, grade, seconds)  # kept for the bench, and graded again if stopped
            elif status == "graded":
                self.state[one["slug"]] = dict(key=key, row=self.rows[i])
                self._write("state.json", json.dumps(self.state, indent=1) + "\n")
            self.write_gradebook()
        self._say(one, summary_line(grade, status, problem, seconds))

    def _write(self, name, text):
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.partial")
        scratch.write_text(text)
        os.replace(scratch, path)  # a Ctrl-C never leaves half a file

    def write_gradebook(self):
        self._write("gradebook.csv", self.book.csv([self.rows[i] for i in sorted(self.rows)]))

    def bench(self):
        """On a GPU, once every learner's tests have run: each passing drill's bench, one at a
        time (a timing shares the GPU with nothing), then that learner's outputs again."""
        import _bench  # Triton's testing helpers: only where there is a GPU to time
        ceiling = _bench.Ceiling()
        try:
            for i, (one, key, grade, seconds) in sorted(self.unbenched.items()):
                for drill in self.drills:
                    s = next((s for s in grade["drills"] if s["id"] == drill.id and s["status"] == "passed"), None)
                    if s is None or self.stopping.is_set():
                        continue
                    bench = _bench.Bench(drill, Path(self.work) / str(i) / "tree")
                    try:
                        grade["ceiling_gbps"] = ceiling.gbps(self.args.timeout)
                        s["bench"] = cleaned(bench.result(grade["ceiling_gbps"], self.args.timeout))
                    except RuntimeError as error:
                        bench.cancel()
                        s["bench"] = dict(error=str(error))
                if self.stopping.is_set():
                    return
                if "ceiling_gbps" in grade:
                    grade.pop("bench_note", None)
                else:
                    grade["bench_note"] = "shown for drills that pass their tests"
                self.record(i, one, key, "graded", grade, None, seconds, final=True)
        finally:
            ceiling.cancel()

    def go(self):
        """Grade the roster; 0 once every learner has a line, 130 when stopped (Ctrl-C, SIGTERM)."""
        todo = [(i, one) for i, one in enumerate(self.learners) if not one["problem"]]
        for i, one in enumerate(self.learners):
            if one["problem"]:
                self.rows[i] = self.book.row(one, "not graded", problem=one["problem"])
                self._say(one, f"not graded: {one['problem']}")
        self.console.print(Text(f"class · {len(todo)} learner(s) × {len(self.drills)} drill(s) · {self.args.jobs} at "
                                f"a time · {__import__('_env').describe() if self.gpu else 'CPU'} · outputs in {self.out}"), highlight=False)
        pending, taking, started = iter(todo), threading.Lock(), time.monotonic()

        def work():
            while not self.stopping.is_set():
                with taking:
                    item = next(pending, None)
                if item is None:
                    return
                try:
                    self.grade(*item)
                except Exception as error:  # the class's own failure: that learner's line, the class goes on
                    self.record(item[0], item[1], None, "crashed", None, f"the class grade failed: {error!r}", 0)

        def stop(signum, frame):
            self.stopping.set()
            for pgid in list(_CHILDREN):
                kill_group(pgid)
            raise KeyboardInterrupt
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        columns = (TextColumn("learners × drills"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("left"), TimeRemainingColumn())
        stopped = False
        try:
            with Progress(*columns, console=self.console, disable=not self.console.is_terminal) as self.progress:
                self.task = self.progress.add_task("class", total=len(todo) * len(self.drills))
                threads = [threading.Thread(target=work, daemon=True, name=f"class job {n}")
                           for n in range(min(self.args.jobs, len(todo)))]
                for thread in threads:
                    thread.start()
                while any(thread.is_alive() for thread in threads):
                    time.sleep(0.1)
            if self.unbenched:
                self.bench()
        except KeyboardInterrupt:
            stopped = True
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        with self.lock:
            self.stopping.set()  # a grade that ends now is not written
            self.write_gradebook()
            self.write_similarity()
        shutil.rmtree(self.work, ignore_errors=True)
        counts = {status: list(self.done.values()).count(status) for status in dict.fromkeys(self.done.values())}
        said = ", ".join(f"{n} {status}" for status, n in counts.items()) or "none graded"
        refused = sum(1 for one in self.learners if one["problem"])
        self.console.print(Text(("stopped: " if stopped else "") + f"{said}" + (f", {refused} not graded" if refused
                                else "") + f" in {time.monotonic() - started:.1f} s; gradebook.csv and similarity.md "
                                f"in {self.out}" + ("; run the same command again to go on" if stopped else "")),
                           highlight=False)
        return 130 if stopped else 0

    def write_similarity(self):
        learners = [one for one in self.learners if not one["problem"]]
        self._write("similarity.md", _similarity.class_report(learners, self.drills, self.stubs, self.args.roster))

    def _advance(self, n):
        if self.progress and n > 0:
            self.progress.advance(self.task, n)

    def _say(self, one, text):
        self.console.print(Text(f"{one['name']}: {text}"), highlight=False)


# --- the command --------------------------------------------------------------------------

def parse(argv, drills):
    parser = argparse.ArgumentParser(prog="grader.py class", description="Grade every learner of a roster.")
    parser.add_argument("roster", help="a folder holding one folder per learner (a tree, or a clone whose mine/ is used)")
    parser.add_argument("--drills", nargs="+", default=None, help="drill ids (default: all), e.g. l1 l2 or l1,l2")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="learners graded at once (default: one per two cores)")
    parser.add_argument("--out", default=str(ROOT / "class-out"), help="where the outputs go (default class-out/)")
    parser.add_argument("--points", nargs="+", default=[], metavar="ID=N",
                        help=f"a drill's weight in results.json and the gradebook (default {POINTS} each)")
    parser.add_argument("--partial", action="store_true", help="a failing drill scores its share of tests passed")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per drill of one learner (default 1200)")
    parser.add_argument("--test-timeout", type=float, default=None, help="seconds the learner's code may run in one test")
    parser.add_argument("--learner-timeout", type=float, default=None,
                        help="seconds one learner's whole grade may take (default: drills x --timeout + 120)")
    parser.add_argument("--no-bench", action="store_true", help="(GPU) skip the bandwidth report")
    args = parser.parse_args(argv)
    known = {d.id: d for d in drills}
    wanted = [w for part in (args.drills or []) for w in part.split(",") if w]
    unknown = [w for w in wanted if w.lower() not in known]
    points = dict(p.split("=", 1) for p in args.points if "=" in p)
    bad = [p for p in args.points if "=" not in p] + [k for k in points if k.lower() not in known]
    if unknown or bad or args.jobs < 1:
        parser.error(f"no drill {', '.join(unknown + bad)} (known: {', '.join(known)})" if unknown or bad
                     else "--jobs must be at least 1")
    try:
        args.points = {k.lower(): float(v) for k, v in points.items()}
    except ValueError:
        parser.error(f"--points takes ID=NUMBER, got {' '.join(args.points)}")
    args.drills = [known[w.lower()] for w in dict.fromkeys(wanted)] or list(drills)
    return args


def _out_problem(out, roster_folder):
    """Why OUT cannot be written to, or None: inside the roster (every learner would be
    graded again, and a folder there is a learner), or inside the project where git would
    see it (the grade hashes the project before and after)."""
    out, roster_folder = out.resolve(), roster_folder.resolve()
    if out == roster_folder or out.is_relative_to(roster_folder):
        return f"--out {out} is inside the roster: put it elsewhere"
    if out.is_relative_to(ROOT):
        ignored = subprocess.run(["git", "check-ignore", "-q", str(out / "gradebook.csv")], cwd=ROOT)
        if ignored.returncode == 1:
            return f"--out {out} is inside the project and not ignored by git: use class-out/ or a folder elsewhere"
    return None


def main(argv, all_drills=None):
    """`grader.py class ...`; the drills: the manifest's ids and stems (the --json gives the rest)."""
    all_drills = all_drills or _catalog.entries()
    console = make_console()
    args = parse(argv, all_drills)
    roster_folder = Path(args.roster).expanduser()
    problem = None if roster_folder.is_dir() else f"roster {args.roster!r} is not a folder"
    problem = problem or _out_problem(Path(args.out).expanduser(), roster_folder)
    try:
        learners = [] if problem else roster(roster_folder, args.drills, [d.stem for d in all_drills])
    except OSError as error:
        problem = f"roster {args.roster!r} cannot be read: {error.strerror or error}"
    if problem:
        console.print(problem, style="red", markup=False, highlight=False)
        return 2
    args.out = str(Path(args.out).expanduser().resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run = ClassRun(args, args.drills, console, learners)
    return run.go()
