# The README's two commands. Each sets up .venv (python3 -m venv + the package with its
# test extras) when it is missing, so a fresh clone needs nothing else.
PY := .venv/bin/python
STAMP := .venv/.jaxwap-installed
# pytest-xdist workers for `make test` (CI: 2 cores); TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2

.PHONY: run test lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/alexnet_flax.py --auto

test: $(STAMP)
	.venv/bin/ruff check jaxwap tests examples benchmarks
	$(PY) -m pytest tests -n $(TEST_WORKERS)

lint: $(STAMP)
	.venv/bin/ruff check jaxwap tests examples benchmarks

clean:
	rm -rf .venv build *.egg-info .pytest_cache
