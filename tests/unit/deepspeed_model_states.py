"""DeepSpeed's own model-state estimators, for test_model_state.cpp to compare against.

Usage: deepspeed_model_states.py '[{"total": P, "largest": L, "world": N}, ...]'
Prints one JSON list, the same order, of the per-GPU bytes DeepSpeed estimates at ZeRO-2 and
ZeRO-3 with and without offload. Ranks are laid out 8 per node (fewer when N < 8). Exit code 3
when DeepSpeed cannot be imported.
"""
import contextlib
import io
import json
import sys

try:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
except Exception as e:  # noqa: BLE001 - any import failure means "no DeepSpeed here"
    print(f"cannot import deepspeed: {e!r}", file=sys.stderr)
    sys.exit(3)

out = []
for case in json.loads(sys.argv[1]):
    total, largest, world = case["total"], case["largest"], case["world"]
    per_node = min(world, 8)
    nodes = world // per_node
    assert per_node * nodes == world, f"world {world} is not a multiple of 8"

    def z2(offload):
        return estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload)[1]

    def z3(offload, offload_params):
        return estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload,
            cpu_offload_params=offload_params)[1]

    out.append({
        "zero2_gpu": z2(False),
        "zero2_offload_gpu": z2(True),
        "zero3_gpu": z3(False, False),
        "zero3_offload_gpu": z3(True, False),
        "zero3_offload_params_gpu": z3(True, True),
        "zero3_largest_layer_bytes": 4 * largest,
    })
print(json.dumps(out))
