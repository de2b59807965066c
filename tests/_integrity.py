"""What the grade stands on, checked before and after it runs. Names no drill.

The learner's code should be unable to write outside its scratch folder (tests/_sandbox.py);
this is the last line of defence: what it could have planted for later (a changed test, a
.pth or sitecustomize every later interpreter runs) is looked for before and after. The
grade stands on the machinery (MACHINERY), the site folders' start-up hooks, and the files
it grades (`graded_files`, watched per drill by grader.py): not on the learner's other
files, which they may edit while a grade runs. A change to the machinery withdraws every
pass; a change to a drill's graded files gives that drill the status "edited during
grading" (`mark_edited`), never a pass or a failure.
"""
import hashlib
import os
import site
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

from _tree import ROOT

# The machinery: tests/, the front, and what configures pytest at the root (a conftest.py,
# pytest.ini, tox.ini or setup.cfg planted there would be read by the next test process).
MACHINERY = ("tests", "grader.py", "pyproject.toml", "Makefile", "conftest.py", "pytest.ini", ".pytest.ini",
             "tox.ini", "setup.cfg")


def _digest(path):
    """sha1 of a regular file's content; a link's target; the kind of anything else
    (never read: a FIFO or a device would block or never end); None if absent."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            return "link to " + os.readlink(path)
        if not stat.S_ISREG(mode):
            return "a folder" if stat.S_ISDIR(mode) else "not a file"
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha1").hexdigest()
    except OSError:
        return None


def _tree_files(root):
    """The machinery's files (MACHINERY): those git tracks or would track (not what
    .gitignore hides: caches); without git, every file there outside dot folders and caches."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *MACHINERY], cwd=root,
                            capture_output=True)
    if listed.returncode == 0:
        return [os.fsdecode(name) for name in listed.stdout.split(b"\0") if name]
    found = [name for name in MACHINERY if os.path.isfile(os.path.join(root, name))]
    for folder, dirs, files in os.walk(os.path.join(root, "tests")):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    return found


def _site_folders():
    """Where a .pth or a sitecustomize/usercustomize runs at every start of this
    interpreter: the site folders (the venv's site-packages, the user's) and sys.path."""
    paths = sysconfig.get_paths()
    folders = {paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", list)(),
               getattr(site, "getusersitepackages", str)(), *(p or os.getcwd() for p in sys.path)}
    return sorted(f for f in folders if os.path.isdir(f))


def snapshot(root=ROOT, site_folders=None):
    """{path: digest} of the machinery the grade stands on, taken before it runs: every file
    of MACHINERY (after is compared with before, not with the commit) and every .pth,
    sitecustomize and usercustomize (file, package or compiled module) in the site folders.
    The graded files are watched per drill (`graded_files`, `edited`)."""
    found = {name: _digest(os.path.join(root, name)) for name in _tree_files(root)}
    for folder in _site_folders() if site_folders is None else site_folders:
        for name in os.listdir(folder):
            if name.endswith(".pth") or name.split(".")[0] in ("sitecustomize", "usercustomize"):
                found[os.path.join(folder, name)] = _digest(os.path.join(folder, name))
    return found


def _shown(path, root):
    """A path as a line shows it: short when under the repository, printable or ascii()."""
    path = str(Path(path).relative_to(root)) if Path(path).is_relative_to(root) else path
    return path if path.isprintable() else ascii(path)


def integrity(root=ROOT, before=None, site_folders=None):
    """(ok, sentence). Without `before`: whether the test machinery is what the repository
    committed (a learner who edited the tests is warned). With the `snapshot` taken before
    the grade: whether any of the machinery or the site folders' hooks changed or appeared
    since (ok None: cannot tell)."""
    if before is not None:
        after = snapshot(root, site_folders)
        changed = [f"{'new' if path not in before else 'removed' if after.get(path) is None else 'changed'} "
                   f"{_shown(path, root)}" for path in sorted(set(before) | set(after))
                   if before.get(path) != after.get(path)]
        if changed:
            return False, (f"changed during grading: {', '.join(changed[:5])}" +
                           (f" and {len(changed) - 5} more" if len(changed) > 5 else ""))
        return True, "nothing the grade stands on (tests/, grader.py, site-packages' hooks) changed during grading"
    check = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *MACHINERY], cwd=root,
                           capture_output=True, text=True)
    if check.returncode != 0:
        return None, "cannot check that tests/ is the committed one (no git history here)"
    changed = [_shown(line[3:], root) for line in check.stdout.splitlines() if "__pycache__" not in line]
    if changed:
        shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
        return False, f"the grading machinery differs from the committed tree: {shown}"
    return True, "tests/ and grader.py are the committed ones"


def graded_files(drill, tree, stems=()):
    """The files a drill's grade runs: <tree>/<stem>.py, and the tree's files of the other
    drills (`stems`) whose module name that file mentions (a capstone importing the same
    tree's kernels)."""
    own = Path(tree) / f"{drill.stem}.py"
    try:  # a regular file's first megabyte, opened without waiting (a FIFO would wait for a writer)
        with os.fdopen(os.open(own, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            text = f.read(1 << 20).decode(errors="replace") if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else ""
    except OSError:
        text = ""
    return [own] + [Path(tree) / f"{stem}.py" for stem in stems if stem != drill.stem and stem in text]


def digests(paths):
    """{path: digest} of these files, taken when a drill's grade starts."""
    return {str(path): _digest(path) for path in paths}


def edited(before, root=ROOT):
    """The files of `digests` that changed since (as a line shows them: mine/l1_paged_kv_write.py)."""
    return [_shown(path, root) for path, digest in before.items() if _digest(path) != digest]


def mark_edited(summary, before, tree_name):
    """A drill whose graded files (`digests` taken when its grade started) changed before its
    grade ended gets the status "edited during grading": the learner saved while it ran, so
    what was graded is not their file any more (never a pass, never a failure)."""
    changed = edited(before)
    if changed:
        from _render import commands
        again = commands(summary["id"], tree_name)["grade"]
        summary.update(status="edited during grading", first_failure=None, diagnosis=[],
                       problem=f"you edited {', '.join(changed)} while it was graded: run `{again}` again")
