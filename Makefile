# Two entry points: `make demo` runs the main job on built-in defaults, `make test` runs the tests.
# Both create .venv on first use with pinned dependencies (torch first: the pinned CPU wheel).
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test test-fast bench gpu-check clean

$(VENV_STAMP): requirements.txt pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m recycle demo --out out/demo

# Both type-check runtime/ and ir/ first ([tool.mypy] in pyproject.toml): a mypy error fails the target.
# make test: two pytest processes side by side (tests/run_suite.py): the tests marked `timing` (heartbeat timeouts,
# paced re-joins) one after the other in one, every other test in the other. (pytest -n 2 ran two timing tests at
# once, which slowed re-joins past the end of short runs.) make test-fast: the tests not marked slow, -n 2.
test: $(VENV_STAMP)
	$(PY) -m mypy
	$(PY) tests/run_suite.py

test-fast: $(VENV_STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

bench: $(VENV_STAMP)
	@for script in benchmarks/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

# On a CUDA machine: executor, bf16, decoupled backward and NCCL abort checks, one JSON summary (< 5 min);
# without CUDA it prints {"skipped": "no CUDA device", ...} and exits 0.
gpu-check: $(VENV_STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf .venv out
