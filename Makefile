# `make run`  : set up .venv and run the main job (personalized FL on a skewed federation, MiniLM, a few min on 2 cores)
# `make test` : set up .venv and run the test suite (three pytest-xdist workers on 2 cores: the longest tests mostly wait on Flower's processes)
# `make lint` : ruff's lint of src/, tests/, benchmarks/ and scripts/, its format check and mypy's type check of src/ (CI runs them too)
.PHONY: setup run test lint

setup: .venv/.installed

.venv/.installed: pyproject.toml constraints.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	.venv/bin/fedloom run examples/quickstart.toml

test: setup
	.venv/bin/python -m pytest -q -n 3 --dist worksteal --durations=25

lint: setup
	.venv/bin/ruff check src tests benchmarks scripts
	.venv/bin/ruff format --check src
	.venv/bin/mypy
