# The front door. Every target sets up .venv on first use.
#   make grade                 grade mine/ (TREE=solutions or TREE=path to grade another tree; DRILL=l1 for one;
#                              TIMEOUT=120: seconds your code may run in one test, default 60)
#   make test                  the whole test suite against solutions/
#   make bench                 the bandwidth report of solutions/ (needs a GPU)
#   make diff DRILL=l1         your file next to the reference, side by side (TREE=path for a learner's copy)
#   make reset DRILL=l1        back up your file to .drills/backups/, then restore the stub
#   make hint DRILL=l1         the next hint from the drill's page
#   make show DRILL=l1         draw the cache your code writes, next to the expected one
#   make watch DRILL=l1        re-grade whenever your file changes
#   make doctor                check Python, torch, Triton, numpy and the interpreter
#   make clean                 remove .venv and caches

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TREE   ?= mine
DRILL  ?=
TIMEOUT ?=

# Without an NVIDIA GPU a plain `pip install torch` can pull a multi-GB CUDA
# build: pin a CPU one there. With a GPU, reuse the system's torch if it has one.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH    ?= $(if $(HAVE_GPU),torch,torch==2.13.0)
VENV_ARGS = $(if $(HAVE_GPU),--system-site-packages)

.PHONY: setup grade test bench diff reset hint show watch doctor clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
		> $(VENV)/requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements.txt
	touch $@

# grader.py exits 1 unless every drill passes (for scripts); for a learner that
# is the normal state of things, not an error of make's.
grade: setup
	@$(PY) grader.py --tree $(TREE) $(if $(TIMEOUT),--test-timeout $(TIMEOUT)) $(DRILL) || true

test: setup
	$(PY) -m pytest --tree solutions -q

bench: setup
	$(PY) grader.py --tree solutions $(DRILL)

diff reset hint show watch: setup
	@test -n "$(DRILL)" || { echo "usage: make $@ DRILL=l1"; exit 2; }
	$(PY) grader.py $@ $(DRILL) --tree $(TREE)

doctor: setup
	$(PY) grader.py doctor

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
