# Entry points: `make demo` (install, build, train the default model, sample) and
# `make test` (build and run every test). BUILD_DIR and JOBS may be overridden.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")

.PHONY: all deps venv build shardlm test test-gpu build-cuda dist dist-cuda demo bench bench-zero bench-context format clean

all: build

deps:
	bash scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt:
	cmake $(GENERATOR) -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Only the binary: the demo does not wait for the tests to compile.
shardlm: $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS) --target shardlm

# The Python references the parity tests compare with (transformers, PEFT, tokenizers,
# DeepSpeed), made or completed once per machine outside the repository. Without them (no
# network) those tests skip saying why, or fail under SHARDLM_REQUIRE_REFERENCES=1 (CI).
venv:
	@bash scripts/setup-venv.sh || { [ "$$SHARDLM_REQUIRE_REFERENCES" != 1 ] && \
	  echo "make: the reference venv is incomplete: the tests that need it will skip"; }

test: build venv
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The CUDA backend (needs nvcc, cuBLASLt; CUDA_ARCHS defaults to Hopper) in its own build tree.
CUDA_BUILD_DIR ?= build-cuda
CUDA_ARCHS ?= 90a
CUDA_TARGETS ?= all
build-cuda:
	cmake $(GENERATOR) -S . -B $(CUDA_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DSHARDLM_CUDA=ON \
	  -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" $(CMAKE_FLAGS)
	cmake --build $(CUDA_BUILD_DIR) -j $(JOBS) --target $(CUDA_TARGETS)

# The tests that need an NVIDIA GPU (CTest label gpu).
test-gpu: build-cuda
	cd $(CUDA_BUILD_DIR) && ctest --output-on-failure -L gpu

# A relocatable directory and tarball under dist/ (portable x86-64-v3, no MPI, libraries in lib/),
# for machines without the build's packages; dist-cuda adds the CUDA backend, the gpu tests and
# scripts/gpu-check.sh's peers (see README "Checking a GPU node").
dist: deps
	bash scripts/make-dist.sh cpu

dist-cuda: deps
	bash scripts/make-dist.sh cuda

# A fresh run every time: a finished runs/demo would otherwise be resumed (and do nothing).
demo: deps shardlm
	bash scripts/prepare-demo-data.sh data/kjv.txt
	OMP_NUM_THREADS=$(JOBS) $(BUILD_DIR)/shardlm train --config configs/demo.json --set train.resume=none

bench: build
	bash bench/run.sh $(BUILD_DIR)

# ZeRO stages against PyTorch DDP/FSDP (and DeepSpeed when installed) over 2 and 4 CPU ranks;
# needs the venv that `make bench` creates.
bench-zero: shardlm
	bash bench/zero.sh $(BUILD_DIR)

# The longest sequence within a per-rank memory budget at 1, 2 and 4 CPU ranks: shardlm's
# context parallelism against PyTorch FSDP; needs the venv that `make bench` creates.
bench-context: shardlm
	bash bench/long_context.sh $(BUILD_DIR)

format:
	git ls-files -co --exclude-standard -- '*.h' '*.cpp' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR) dist
