# Set-up is part of every target: a fresh machine needs only python3 (3.10+).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# pinned: this CPU build installs from the machine's local wheels; an
	# unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[examples,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/digits.py

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
