# The two commands of the README:
#   make serve   set up and serve the embedded default on 127.0.0.1:50051
#   make test    set up and run the whole test suite
.PHONY: serve test setup protos lint

serve:
	./scripts/setup.sh
	.venv/bin/mmserve serve $(ARGS)

test:
	./scripts/setup.sh --test
	.venv/bin/python -m pytest -q -p no:cacheprovider $(ARGS)

protos:
	./scripts/gen_protos.sh

lint:
	.venv/bin/ruff check mmserve kernels processors clients tests
