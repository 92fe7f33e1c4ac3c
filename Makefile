# `make run`  : set up .venv and run the main job (personalized FL on a skewed federation, MiniLM, a few min on 2 cores)
# `make test` : set up .venv and run the test suite
.PHONY: setup run test

setup: .venv/.installed

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

run: setup
	.venv/bin/fedloom run examples/quickstart.toml

test: setup
	.venv/bin/python -m pytest -q
