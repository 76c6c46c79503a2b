# The two commands of the README:
#   make serve   set up and serve the embedded default on 127.0.0.1:50051
#   make test    set up, run the whole test suite and `make check`
# make check: ruff, mypy, buf lint of protos/, generated stubs up to date (needs setup.sh --test).
.PHONY: serve test setup protos lint check

serve:
	./scripts/setup.sh
	.venv/bin/mmserve serve $(ARGS)

# pytest-xdist workers: two fit the CI machine (2 cores, 24 GiB), each loads its own models
WORKERS ?= 2

# The checks run even when a test fails (one CI run reports both); either failing fails the run.

test:
	./scripts/setup.sh --test
	.venv/bin/python -m pytest -q -p no:cacheprovider -n $(WORKERS) $(ARGS); status=$$?; \
	  $(MAKE) --no-print-directory check || status=1; exit $$status

protos:
	./scripts/gen_protos.sh

lint:
	.venv/bin/ruff check mmserve clients tests

check: lint
	PYTHON=$(CURDIR)/.venv/bin/python ./scripts/typecheck.sh
	./scripts/lint_protos.sh --strict
	PYTHON=$(CURDIR)/.venv/bin/python ./scripts/gen_protos.sh --check
