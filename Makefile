# Set-up is part of every target: a fresh machine needs only python3 (3.10+).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the benchmark's own environment: peers (Ignite, Lightning) are installed here only
BVENV  ?= .venv-bench
BSTAMP := $(BVENV)/.installed

.PHONY: demo test browser screenshots docs docs-serve bench bench-ddp clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# pinned: this CPU build installs from the machine's local wheels; an
	# unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[examples,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/digits.py

test: $(STAMP) browser
	# two workers, one a core (pytest-xdist); the torchrun tests share one worker (tests/conftest.py)
	$(PY) -m pytest -n 2 --dist loadgroup

# the web app's browser tests drive Debian's chromium through its chromedriver (tests/integration/
# test_web_browser.py): installed here when missing and this runs as root with apt (CI); elsewhere,
# or when the install fails, those tests are skipped and say why
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium and chromium-driver (Debian) for the browser tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver \
	      >/dev/null) || echo "could not install chromium: the browser tests will be skipped"; \
	  else \
	    echo "no chromium, and not root with apt-get: the browser tests will be skipped"; \
	  fi; \
	fi

# the web app's screenshots in README.md and docs/guides/web.md (docs/images/web-*.png), taken by its browser
# tests: only here (a test run writes nothing into the tree)
screenshots: $(STAMP) browser
	NNX_ES_SCREENSHOTS=1 $(PY) -m pytest -q -p no:cacheprovider tests/integration/test_web_browser.py

# the documentation site, built in strict mode (a broken link or reference fails) into site/
docs: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs serve

$(BSTAMP): pyproject.toml
	python3 -m venv $(BVENV)
	$(BVENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BVENV)/bin/python -m pip install --quiet -e '.[examples]' 'pytorch-ignite>=0.5' 'pytorch-lightning>=2.4'
	touch $(BSTAMP)

bench: $(BSTAMP)
	$(BVENV)/bin/python -m bench.run --markdown BENCHMARKS.md
	# its own section (bench/markdown.py): a 2-rank torchrun (gloo) of nnx_es DDP against a hand-written DDP loop
	$(BVENV)/bin/python -m bench.ddp --markdown BENCHMARKS.md

bench-ddp: $(STAMP)
	$(PY) -m bench.ddp

clean:
	rm -rf $(VENV) $(BVENV) runs site .pytest_cache
