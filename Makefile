# The front door. Every target sets up .venv on first use.
#   make setup                 create .venv with what the drills need (torch, Triton, numpy, pytest, rich:
#                              see "Set-up" below); every other target runs it first, and once .venv is
#                              ready it does nothing
#   make grade                 grade mine/ (TREE=solutions or TREE=path to grade another tree; DRILL=l1 for one;
#                              TIMEOUT=120: seconds your code may run in one test, default 60;
#                              KERNELS=solutions: E1 runs on the reference L1 and L3 instead of yours)
#   make test                  the whole test suite against solutions/
#   make chat                  your E1 engine serving SmolLM2-135M-Instruct on your L1 and L3, a line per step,
#                              checked against transformers' generate (PROMPT="a|b": prompts; TOKENS=16;
#                              KERNELS=, TREE= as in grade; MODEL=path: a checkpoint folder); TURNS=3 or
#                              PROMPTS_FILE=path (a message a line): a chat on your E2 engine, each turn's
#                              reuse shown; installs the model on first use
#   make bench                 the bandwidth report of solutions/ (DRILL=l1 for one); without a GPU, at
#                              once, the reference's traffic lines instead
#   make diff DRILL=l1         your file against the reference: side by side ('|' changed, '<' '>' one side
#                              only) from 120 columns, else a unified diff; TREE=path for a learner's copy,
#                              OTHER=path to put a second learner's copy where the reference was
#   make reset DRILL=l1        back up your file to .drills/backups/, then restore the stub
#   make hint DRILL=l1         the next hint (content/l1-hints.md), one at a time; progress in .drills/hints.json
#   make walkthrough DRILL=l1  the reference read line by line (content/l1-walkthrough.md); until L1's last
#                              grade passed it asks first (YES=1: without asking)
#   make page DRILL=l1         the drill's page rendered in the terminal, self-test answers folded
#                              (ANSWERS=1: shown; on a terminal, Enter after the page shows them)
#   make show DRILL=l1         draw what your code gives on a small case (exits 0 whenever it draws)
#   make watch DRILL=l1        re-grade whenever your file changes
#   make doctor                check Python, torch, Triton, numpy and the interpreter
#   make class ROSTER=dir      grade every learner of a roster (a folder of trees or clones) into class-out/:
#                              gradebook.csv, feedback, Gradescope's results.json, similarity.md; DRILL=l1,l2,
#                              JOBS=2, OUT=dir (README, "For instructors")
#   make clean                 remove .venv and caches

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TREE   ?= mine
DRILL  ?=
TIMEOUT ?=
KERNELS ?=
OTHER  ?=
ROSTER ?=
JOBS   ?=
OUT    ?=
YES     ?=
ANSWERS ?=

# Set-up is decided by tests/_setup.py, which prints the path it took. Without an
# NVIDIA GPU, torch comes from PyTorch's CPU index (a ~192 MB wheel rather than
# ~2.5 GB of CUDA ones) when it answers within 3 s, else from the default index;
# with a GPU the venv reuses the system's torch. uv installs when it can be had.
#   TORCH=spec         another torch requirement
#   TORCH_INDEX=URL    torch from this index (a mirror); TORCH_INDEX=default: the default index
#   INSTALLER=pip|uv   force an installer
TORCH       ?=
TORCH_INDEX ?=
INSTALLER   ?=

.PHONY: setup grade test chat bench diff reset hint walkthrough page show watch doctor clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml
	TORCH='$(TORCH)' TORCH_INDEX='$(TORCH_INDEX)' INSTALLER='$(INSTALLER)' $(PYTHON) tests/_setup.py --venv $(VENV)
	touch $@

# grader.py exits 1 unless every drill passes (for scripts); for a learner that
# is the normal state of things, not an error of make's.
grade: setup
	@DRILLS_KERNELS='$(KERNELS)' $(PY) grader.py --tree $(TREE) $(if $(TIMEOUT),--test-timeout $(TIMEOUT)) $(DRILL) || { code=$$?; [ $$code -eq 1 ] || exit $$code; }

# E1's real model (SmolLM2-135M-Instruct: tests/drills/e1/cases.py), an optional extra:
# installed for the tests and for chat, never by plain set-up (make grade).
$(VENV)/.e1-model: $(VENV)/.ready
	INSTALLER='$(INSTALLER)' $(PYTHON) tests/_setup.py --venv $(VENV) --extra e1-model
	touch $@

test: setup $(VENV)/.e1-model
	$(PY) -m pytest --tree solutions -q

PROMPT ?=
TOKENS ?=
MODEL  ?=
TURNS  ?=
PROMPTS_FILE ?=
export PROMPT  # read as "$$PROMPT" by the shell: a prompt may hold any quote
chat: setup $(VENV)/.e1-model
	@DRILLS_KERNELS='$(KERNELS)' $(PY) grader.py chat --tree $(TREE) --prompt "$$PROMPT" \
		$(if $(TOKENS),--tokens $(TOKENS)) $(if $(MODEL),--model '$(MODEL)') $(if $(TIMEOUT),--timeout $(TIMEOUT)) \
		$(if $(TURNS),--turns $(TURNS)) $(if $(PROMPTS_FILE),--prompts-file '$(PROMPTS_FILE)')

# Without a GPU it says so at once and prints the reference's traffic lines (no test runs).
bench: setup
	$(PY) grader.py bench $(DRILL)

diff reset hint walkthrough page show watch: setup
	@test -n "$(DRILL)" || { echo "usage: make $@ DRILL=l1"; exit 2; }
	$(PY) grader.py $@ $(DRILL) --tree $(TREE)$(if $(and $(filter diff,$@),$(OTHER)), --other $(OTHER))$(if \
		$(and $(filter walkthrough,$@),$(filter-out 0,$(YES))), --yes)$(if $(and $(filter page,$@),$(filter-out 0,$(ANSWERS))), --answers)$(if $(filter watch,$@), || { code=$$?; [ $$code -eq 130 ] || exit $$code; })

doctor: setup
	$(PY) grader.py doctor

.PHONY: class
class: setup
	@test -n "$(ROSTER)" || { echo "usage: make class ROSTER=dir [DRILL=l1,l2] [JOBS=2] [OUT=dir]"; exit 2; }
	$(PY) grader.py class '$(ROSTER)' $(if $(DRILL),--drills $(DRILL)) $(if $(JOBS),--jobs $(JOBS)) $(if $(OUT),--out '$(OUT)')

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
