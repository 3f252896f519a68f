# graphborrow: `make run` sets up and runs the main job, `make test` sets up and runs every test.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is the default here; on a GPU machine use e.g. TORCH_SPEC='torch>=2.8'
# with a CUDA wheel index, or point VENV at an environment that already has CUDA torch.
TORCH_SPEC ?= torch==2.13.0
# No MPLBACKEND here: notebook kernels must keep the inline backend so executed notebooks
# hold their figures (headless matplotlib picks Agg by itself in plain Python).
export PYTHONUNBUFFERED := 1

.PHONY: setup run demo test test-core test-notebooks test-nbval test-gpu test-kernels-deep browser bench bench-kernels compile-kernels bench-sweep gpu-wheels model-pools model-pools-sim fuzz-sim fuzz-sim-dry fuzz-sim-replay strip clean deep mutation mutation-capacity

setup: $(VENV)/.installed
	$(PY) -m graphborrow build

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	# torch first, so the extras (triton among them) never pull in a CUDA build of torch
	$(PY) -m pip install -q -e ".[notebooks,test,models,kernels]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

run: setup
	$(PY) -m graphborrow run

demo: setup
	$(PY) -m graphborrow demo

# Debian's Chromium for the browser test (Playwright drives it by executable path).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi; }

# CPU-only: GPU twins are deselected (not skipped); the simulated device runs the story.
# The notebook points run first: the browser test opens the notebooks they executed.
test: setup browser
	$(MAKE) --no-print-directory test-nbval
	rm -rf output/points
	$(PY) scripts/notebook_points.py --skip-defaults --samples $(POINT_SAMPLES) --seed $(POINT_SEED) --jobs 2 --out output/points
	$(PY) -m pytest -q -m "not gpu" tests

test-core: setup
	$(PY) -m pytest -q -m "not gpu and not browser" tests

# Every numbered notebook at its defaults, the low and high corners of its declared ranges, the
# H200 shapes and POINT_SAMPLES seeded random points, two at a time on the simulated device
# (large points layout-only). A point passes when the notebook ran to the end, wrote results
# with device work and shows an image for every cell tagged 'figure'. Executed notebooks and
# report.json land in output/points/.
POINT_SAMPLES ?= 1
POINT_SEED ?= 0
test-notebooks: setup
	rm -rf output/points
	$(PY) scripts/notebook_points.py --samples $(POINT_SAMPLES) --seed $(POINT_SEED) --jobs 2 --out output/points

# nbval: every notebook once more, cell by cell, on the simulated device; the guard then checks
# each one wrote results showing device work (not part of make test: the points cover it).
test-nbval: setup
	rm -rf notebooks/results
	start=$$(date +%s); \
	$(PY) -m pytest -q -p no:python --nbval-lax --nbval-current-env \
	  --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks/ && \
	$(PY) scripts/check_notebook_results.py --since $$start

# Property tests and randomized stress loops (interrupts included), 50x longer: the
# Hypothesis "deep" profile (tests/conftest.py). Not part of CI; tens of minutes.
deep: setup
	GRAPHBORROW_HYPOTHESIS=deep $(PY) -m pytest -q -p no:cacheprovider -m "property and not gpu" tests

# Mutation testing (not in CI; about three hours on 2 cores): mutmut 3 over the modules that
# hold rules ([tool.mutmut] in pyproject.toml) and the simulated allocator's statistics (pure
# Python, so the mutated source is what runs), a hand-rolled pass over arena.c, one record of
# both with the survivors judged harmless in data/mutation.json. For a shorter run, name a
# deterministic sample once mutants/ exists: scripts/mutation_sample.py.
MUTATION_PATTERNS = 'graphborrow.core.arena.*' 'graphborrow.core.runs.*' 'graphborrow.core.snapshot.*' 'graphborrow.core.borrow.*' \
	'graphborrow.allocator.caching.x*Stat*' 'graphborrow.allocator.caching.x_update_stat_array*' 'graphborrow.allocator.caching.x*_take_over_stats*'
mutation: setup
	$(PY) -m pip install -q -e ".[mutation]"
	rm -rf mutants
	GRAPHBORROW_SIM_PURE=1 OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTATION_PATTERNS)
	$(PY) scripts/mutate_arena_c.py --json data/mutation_arena_c.json --jobs 2
	$(PY) scripts/mutation_report.py --out data/mutation.json

# On a CUDA machine: the GPU twins of the borrow tests.
test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

# CPU: every case of the fused kernels' interpreter tests (several minutes on 2 cores; CI runs one case per rule).
test-kernels-deep: setup
	GRAPHBORROW_KERNEL_TESTS=deep $(PY) -m pytest -q tests/eagle/test_fused_verify.py tests/eagle/test_fused_compile.py

# On a CUDA machine: the fused verification kernels against the reference and the upstream figures.
bench-kernels: setup
	$(PY) benchmarks/verify_kernels.py --out data/verify_kernels_h200.json --profile

# Without a GPU: compile every fused kernel variant for sm_90 (Triton's bundled ptxas); registers, spills.
compile-kernels: setup
	TRITON_INTERPRET=0 $(PY) scripts/compile_kernels.py

# CPU: the simulated allocator's speed, compiled against pure Python (figure in the README).
bench: setup
	$(PY) benchmarks/sim_allocator.py docs/sim_allocator_speed.png --json data/sim_allocator_cpu.json --pairs 50000 --repeats 5

# CPU: the same 16-point sweep on 1 and 2 workers of the embedded Dask cluster.
bench-sweep: setup
	$(PY) benchmarks/sweep_dask.py --workers 1,2 --rounds 2 --out data/sweep_dask_cpu.json

# The wheels the GPU machine lacks for sweeps and the suite (Python 3.12), into .whl/.
gpu-wheels: setup
	$(PY) scripts/gpu_wheels.py --dest .whl

# On a CUDA machine: real transformers models' pools, traces and fits (data/models_h200/), then the
# README table with the simulator's block-for-block agreement.
model-pools: setup
	$(PY) benchmarks/model_pools.py --out data/models_h200
	$(PY) scripts/model_pools_table.py data/models_h200 --readme README.md

# CPU: the same study on the layout-only simulated device (a dry run of the GPU script).
model-pools-sim: setup
	$(PY) benchmarks/model_pools.py --device sim --out output/model-pools-sim
	$(PY) scripts/model_pools_table.py output/model-pools-sim --no-compare --marker model-pools-sim --readme README.md

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
mutation-capacity: setup
	$(PY) -m pip install -q -e ".[mutation]"
	rm -rf mutants
	OMP_NUM_THREADS=1 $(PY) -m mutmut run --max-children 2 'graphborrow.planning.capacity.*' 'graphborrow.planning.planner.*' 'graphborrow.eagle.plan.*'
	OMP_NUM_THREADS=1 $(PY) scripts/mutation_score.py data/mutation_capacity.json 'graphborrow.planning.capacity.*' 'graphborrow.planning.planner.*' 'graphborrow.eagle.plan.*'

strip:
	$(PY) scripts/strip_notebooks.py notebooks/*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache notebooks/results output test-artifacts build dist
