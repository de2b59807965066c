# The front door. Every target sets up .venv on first use.
#   make grade                 grade mine/ (TREE=solutions or TREE=path to grade another tree; DRILL=l1 for one)
#   make test                  the whole test suite against solutions/
#   make bench                 the bandwidth report of solutions/ (needs a GPU)
#   make diff DRILL=l1         your file next to the reference (TREE=path for a learner's copy)
#   make clean                 remove .venv and caches

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TREE   ?= mine
DRILL  ?=

# Without an NVIDIA GPU a plain `pip install torch` can pull a multi-GB CUDA
# build: pin a CPU one there. With a GPU, reuse the system's torch if it has one.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH    ?= $(if $(HAVE_GPU),torch,torch==2.13.0)
VENV_ARGS = $(if $(HAVE_GPU),--system-site-packages)

.PHONY: setup grade test bench diff clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
		> $(VENV)/requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements.txt
	touch $@

grade: setup
	$(PY) grader.py --tree $(TREE) $(DRILL)

test: setup
	$(PY) -m pytest --tree solutions -q

bench: setup
	$(PY) grader.py --tree solutions $(DRILL)

diff:
	@test -n "$(DRILL)" || { echo "usage: make diff DRILL=l1 [TREE=path]"; exit 2; }
	@stem=$$(basename solutions/$(DRILL)_*.py .py); \
	 if [ "$(TREE)" = mine ]; then t=mine; else t="$(TREE)"; fi; \
	 diff -u --color=auto "solutions/$$stem.py" "$$t/$$stem.py"; true

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
