# graphborrow: `make run` sets up what the main job needs and runs it; `make test` sets up the
# test tools too and runs every test CI runs; `make docs` builds the documentation site.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is the default here; on a GPU machine use e.g. TORCH_SPEC='torch>=2.8'
# with a CUDA wheel index, or point VENV at an environment that already has CUDA torch.
TORCH_SPEC ?= torch==2.13.0
# No MPLBACKEND here: notebook kernels must keep the inline backend so executed notebooks
# hold their figures (headless matplotlib picks Agg by itself in plain Python).
export PYTHONUNBUFFERED := 1

.PHONY: setup setup-test setup-docs run demo lab test test-deep test-core test-notebooks test-nbval test-gpu test-kernels-deep browser docs bench bench-kernels compile-kernels bench-sweep bench-scaling gpu-wheels model-pools model-pools-sim decode-loop decode-loop-sim fuzz-sim fuzz-sim-dry fuzz-sim-replay record-wrapped replay-corpus strip clean deep mutation mutation-capacity mutation-sampling

# What `make run` needs and nothing more: torch (CPU build), the package, papermill, Dask and the
# explorer's widgets (extra `run`). Test tools, transformers, triton and JupyterLab come with the
# targets that use them.
setup: $(VENV)/.installed
	$(PY) -m graphborrow build

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[run]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -c "from graphborrow.run.kernels import install_kernelspec; install_kernelspec()"
	touch $@

# The test tools, real model code (transformers), the fused kernels' interpreter (triton, after the
# CPU torch so it never pulls in a CUDA build) and JupyterLab for the browser test.
setup-test: setup $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[notebooks,test,models,kernels]"
	touch $@

setup-docs: setup $(VENV)/.installed-docs

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# The core demo, the example sweep, then every notebook (06 reads the sweep just run).
run: setup
	$(PY) -m graphborrow run

demo: setup
	$(PY) -m graphborrow demo

# JupyterLab on the notebooks (installs it the first time).
lab: setup
	$(PY) -m pip install -q -e ".[notebooks]"
	cd notebooks && $(abspath $(PY)) -m jupyterlab

# Debian's Chromium for the browser test (Playwright drives it by executable path).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi; }

# CPU-only: GPU twins are deselected (not skipped); the simulated device runs the story.
# nbval runs every notebook at its defaults; the points harness runs each at the H200 preset (the
# browser test then opens those executed notebooks); then pytest, whose property tests draw the same
# examples every run (tests/conftest.py). The notebooks' corners and random points, the tests marked
# deep (long repeats of a check make test or another target makes, each saying which) and a random
# search of the property tests run in `make test-deep`.
POINT_LABELS ?= h200
# both cores, whole modules per worker, the modules marked slow handed out first (tests/conftest.py)
PYTEST_TWO_WORKERS = -q -n 2 --dist loadscope --no-loadscope-reorder
test: setup-test browser
	$(MAKE) --no-print-directory test-nbval
	rm -rf output/points
	$(PY) -m graphborrow points --labels $(POINT_LABELS) --jobs 2 --out output/points
	OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_TWO_WORKERS) -m "not gpu and not deep" tests

# Everything `make test` leaves out: every notebook at the low and high corners of its ranges, the
# H200 preset and POINT_SAMPLES seeded random points (DEVICE=sim), then the tests marked deep and a
# random search of every property test (Hypothesis's "search" profile: make test's numbers of
# examples, drawn from HYPOTHESIS_SEED, printed first; a failure prints the command that replays
# it); about 8 minutes on 2 cores.
POINT_SAMPLES ?= 1
POINT_SEED ?= 0
ifndef HYPOTHESIS_SEED
HYPOTHESIS_SEED := $(shell python3 -c "import random; print(random.randrange(2**32))")
endif
test-deep: setup-test browser
	rm -rf output/points-deep
	$(PY) -m graphborrow points --skip-defaults --samples $(POINT_SAMPLES) --seed $(POINT_SEED) --jobs 2 --out output/points-deep
	@echo "random search from seed $(HYPOTHESIS_SEED) (the same search again: make test-deep HYPOTHESIS_SEED=$(HYPOTHESIS_SEED))"
	GRAPHBORROW_HYPOTHESIS=search OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_TWO_WORKERS) -p no:cacheprovider \
	  --hypothesis-seed=$(HYPOTHESIS_SEED) -m "(deep or property) and not gpu" tests

test-core: setup-test
	$(PY) -m pytest -q -m "not gpu and not browser" tests

# Every numbered notebook at every point of its space (defaults included), two at a time. A point
# passes when the notebook ran to the end, wrote results with device work and shows an image for
# every cell tagged 'figure'. Executed notebooks and report.json land in output/points/.
test-notebooks: setup-test
	rm -rf output/points
	$(PY) -m graphborrow points --samples $(POINT_SAMPLES) --seed $(POINT_SEED) --jobs 2 --out output/points

# nbval: every notebook at its defaults, cell by cell, on the simulated device, two notebooks at a
# time on kernels forked from a warm kernel server (the kernelspec graphborrow-forked, this
# environment's Python); the guard then checks each one wrote results showing device work.
test-nbval: setup-test
	rm -rf notebooks/results
	start=$$(date +%s); \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:python -n 2 --dist loadfile --nbval-lax \
	  --nbval-kernel-name graphborrow-forked --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks/ && \
	$(PY) -m graphborrow check-results --since $$start

# The documentation site (output/site): docs/ and the executed notebooks, figures included. It takes
# them from DOCS_NOTEBOOKS (executed copies, e.g. output/suite after make run, or output/points after
# make test); without one it runs the suite first. --strict fails on a broken internal link.
DOCS_NOTEBOOKS ?= output/suite
docs: setup-docs
	test -f $(DOCS_NOTEBOOKS)/00_overview.ipynb -o -f $(DOCS_NOTEBOOKS)/00_overview/h200.ipynb || \
	  $(PY) -m graphborrow suite --device sim --out $(DOCS_NOTEBOOKS)
	$(PY) -m graphborrow docs --notebooks $(DOCS_NOTEBOOKS) --out output/site

# Property tests and randomized stress loops (interrupts included), 50x longer: the
# Hypothesis "deep" profile (tests/conftest.py), drawn from HYPOTHESIS_SEED like test-deep's.
# Not part of CI; tens of minutes.
deep: setup-test
	@echo "random search from seed $(HYPOTHESIS_SEED) (the same search again: make deep HYPOTHESIS_SEED=$(HYPOTHESIS_SEED))"
	GRAPHBORROW_HYPOTHESIS=deep $(PY) -m pytest -q -p no:cacheprovider --hypothesis-seed=$(HYPOTHESIS_SEED) \
	  -m "property and not gpu" tests

# Mutation testing (not in CI; about three hours on 2 cores): mutmut 3 over the modules that
# hold rules ([tool.mutmut] in pyproject.toml) and the simulated allocator's statistics
# (allocator/stats.py and restore's take_over_stats, run as pure Python so the mutated source is what runs), a hand-rolled pass over arena.c, one record of
# both with the survivors judged harmless in data/mutation.json. For a shorter run, name a
# deterministic sample once mutants/ exists: scripts/mutation_sample.py.
MUTATION_PATTERNS = 'graphborrow.core.arena.*' 'graphborrow.core.runs.*' 'graphborrow.core.snapshot.*' 'graphborrow.core.borrow.*' \
	'graphborrow.allocator.stats.*' 'graphborrow.allocator.restore.x_take_over_stats*'
mutation: setup-test
	$(PY) -m pip install -q -e ".[mutation]"
	rm -rf mutants
	GRAPHBORROW_SIM_PURE=1 OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTATION_PATTERNS)
	$(PY) scripts/mutate_arena_c.py --json data/mutation_arena_c.json --jobs 2
	$(PY) scripts/mutation_report.py --out data/mutation.json

# On a CUDA machine: the GPU twins of the borrow tests.
test-gpu: setup-test
	$(PY) -m pytest -q -m gpu tests

# CPU: every case of the fused kernels' interpreter tests (several minutes on 2 cores; CI runs one case per rule).
test-kernels-deep: setup-test
	GRAPHBORROW_KERNEL_TESTS=deep $(PY) -m pytest -q tests/eagle/test_fused_verify.py tests/eagle/test_fused_compile.py

# On a CUDA machine: the fused verification kernels against the reference and the upstream figures.
bench-kernels: setup-test
	$(PY) benchmarks/verify_kernels.py --out data/verify_kernels_h200.json --profile

# Without a GPU: compile every fused kernel variant for sm_90 (Triton's bundled ptxas); registers, spills.
compile-kernels: setup-test
	TRITON_INTERPRET=0 $(PY) scripts/compile_kernels.py

# CPU: the simulated allocator's speed, compiled against pure Python (figure in the README).
bench: setup-test
	$(PY) benchmarks/sim_allocator.py docs/sim_allocator_speed.png --json data/sim_allocator_cpu.json --pairs 50000 --repeats 5

# CPU: how each public entry point's time grows with its input (a few minutes; docs/reliability.md).
bench-scaling: setup
	$(PY) benchmarks/scaling.py --json data/scaling_cpu.json

# CPU: the same 16-point sweep on 1 and 2 workers of the embedded Dask cluster.
bench-sweep: setup-test
	$(PY) benchmarks/sweep_dask.py --workers 1,2 --rounds 2 --out data/sweep_dask_cpu.json

# The wheels the GPU machine lacks for sweeps and the suite (Python 3.12), into .whl/.
gpu-wheels: setup
	$(PY) scripts/gpu_wheels.py --dest .whl

# On a CUDA machine: real transformers models' pools, traces and fits (data/models_h200/), then the
# README table with the simulator's block-for-block agreement.
model-pools: setup-test
	$(PY) benchmarks/model_pools.py --out data/models_h200
	$(PY) scripts/model_pools_table.py data/models_h200 --readme docs/measurements.md

# CPU: the same study on the layout-only simulated device (a dry run of the GPU script).
model-pools-sim: setup-test
	$(PY) benchmarks/model_pools.py --device sim --out output/model-pools-sim
	$(PY) scripts/model_pools_table.py output/model-pools-sim --no-compare --marker model-pools-sim --readme docs/measurements.md

# On a CUDA machine: speculative decoding end to end, borrowing off and on, every mode in one process
# per draft-tree size (data/decode_loop_<device>.json; recordings and a memory_viz file beside it, in
# data/decode_loop_<device>/); about 6 minutes on one H100 or H200. --quick: a smoke run.
decode-loop: setup-test
	$(PY) benchmarks/decode_loop.py

# CPU: the same grid on the layout-only simulated device, 2 steps a point (a dry run of the GPU script).
decode-loop-sim: setup-test
	$(PY) benchmarks/decode_loop.py --device sim --out output/decode_loop_sim.json

# On a CUDA machine: record more of the differential corpus (random programs of the operations model
# code uses, CUDA's capture rules, one-operation probes, ordinary transformers scripts), each in a
# fresh process; pack the folder into data/fuzz with graphborrow.fidelity.fuzz.corpus.pack.
FUZZ_SEEDS ?= 241:400
FUZZ_JOBS ?= 14
fuzz-sim: setup
	$(PY) scripts/record_fuzz.py output/fuzz-h200 --seeds $(FUZZ_SEEDS) --jobs $(FUZZ_JOBS)

# CPU: the recorder's dry run on the simulated device (a few programs of each kind but the models).
fuzz-sim-dry: setup
	$(PY) scripts/record_fuzz.py output/fuzz-sim --seeds 0:4 --kinds rule,probe,fuzz --device sim --jobs 2

# CPU: every committed program against its H200 recording (make test runs every rule, a model
# script per family and a sample of the random programs); agreement per program in the json.
fuzz-sim-replay: setup
	OMP_NUM_THREADS=1 $(PY) scripts/replay_fuzz.py --jobs 2 --json output/fuzz_replay.json
	GRAPHBORROW_FUZZ=all OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/fidelity/test_fuzz_corpus.py

# Mutation testing of the capacity planner (not in CI; 15 to 40 minutes on 2 cores, by load).
# Fails when a survivor is neither killed nor reviewed as harmless in scripts/mutation_score.py.
mutation-capacity: setup-test
	$(PY) -m pip install -q -e ".[mutation]"
	rm -rf mutants
	OMP_NUM_THREADS=1 $(PY) -m mutmut run --max-children 2 'graphborrow.planning.capacity.*' 'graphborrow.planning.planner.*' 'graphborrow.eagle.plan.*'
	OMP_NUM_THREADS=1 $(PY) scripts/mutation_score.py data/mutation_capacity.json 'graphborrow.planning.capacity.*' 'graphborrow.planning.planner.*' 'graphborrow.eagle.plan.*'

# Mutation testing of the verification's sampling rules: the target probabilities' formula, top-k /
# top-p, the tree walk and acceptance theory (not in CI; about 20 minutes on 2 cores). Fails like
# mutation-capacity when a survivor is neither killed nor reviewed as harmless.
SAMPLING_MUTANTS = 'graphborrow.eagle.probs.*' 'graphborrow.eagle.renorm.*' 'graphborrow.eagle.tree_sampling.*' 'graphborrow.eagle.acceptance.*'
mutation-sampling: setup-test
	$(PY) -m pip install -q -e ".[mutation]"
	rm -rf mutants
	OMP_NUM_THREADS=1 $(PY) -m mutmut run --max-children 2 $(SAMPLING_MUTANTS)
	OMP_NUM_THREADS=1 $(PY) scripts/mutation_score.py --make mutation-sampling data/mutation_sampling.json $(SAMPLING_MUTANTS)

# On a CUDA machine: traces whose ring buffer wrapped (long runs of the suite's serving workload, model
# code and the corpus's random program, rings of 100 to 10 000 entries, cut at several points) into
# data/traces/wrapped/; tests/fidelity/test_wrapped_traces.py replays them all.
record-wrapped: setup
	$(PY) scripts/record_wrapped.py data/traces/wrapped --jobs 6

# CPU: replay a folder of traces on the simulated allocator and print the agreement of each
# (CORPUS=data/traces/wrapped for the wrapped traces; add ARGS='--json FILE --label NAME' to record the run).
CORPUS ?= data/traces/corpus
replay-corpus: setup
	$(PY) -m graphborrow replay-corpus --corpus $(CORPUS) $(ARGS)

strip:
	$(PY) scripts/strip_notebooks.py notebooks/*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache notebooks/results output test-artifacts build dist docs/notebooks
