"""Which `sgl_kernel` names SGLang 0.5.23 needs on an x86 CPU (no AMX), and where (paths relative to site-packages).

Found by an AST scan of the installed sglang tree (every `sgl_kernel` import and `torch.ops.sgl_kernel` lookup, each
enclosing `if` evaluated for an x86 CPU without AMX) and checked against a live server that logged every name read.
Pinned to sglang==0.5.23: when the pin moves, scan again.

Every name below exists; only `assign_req_to_token_pool_cpu` does real work, every other one raises
NotImplementedError when called.
"""

SGLANG_VERSION = "0.5.23"

# `from sgl_kernel[.sub] import NAME` executed at IMPORT time of an sglang module on a CPU build
# (module-level code on the `_is_cpu` branch, or unconditional in a module).
IMPORT_TIME = {
    "sgl_kernel": {
        "assign_req_to_token_pool_cpu": ["sglang/srt/mem_cache/allocation.py:46"],  # implemented
        "copy_all_layer_kv_cache_cpu": ["sglang/kernels/ops/kvcache/cache_move.py:10"],
        "assign_draft_cache_locs_contiguous_cpu": ["sglang/kernels/ops/speculative/cache_locs.py:28"],
        "assign_extend_cache_locs_cpu": ["sglang/kernels/ops/speculative/cache_locs.py:28"],
        "fill_accept_out_cache_loc_cpu": ["sglang/kernels/ops/speculative/eagle.py:10"],
        "fill_bonus_tokens_cpu": ["sglang/kernels/ops/speculative/eagle.py:10"],
        "rotate_input_ids_cpu": ["sglang/kernels/ops/speculative/multi_layer_eagle.py:25"],
        "build_tree_kernel_efficient_cpu": ["sglang/kernels/ops/speculative/spec_tree.py:40"],
        "verify_tree_greedy_cpu": ["sglang/kernels/ops/speculative/spec_tree.py:43"],
        # unconditional imports in modules that only specific backends / models import
        "silu_and_mul": ["sglang/srt/layers/moe/fused_moe_triton/triton_kernels_moe.py:32",
                         "sglang/srt/layers/moe/cutlass_w4a8_moe.py:25"],
        "gelu_and_mul": ["sglang/srt/layers/moe/fused_moe_triton/triton_kernels_moe.py:32"],
        "merge_state_v2": ["sglang/srt/layers/attention/flashattention_backend.py:62",
                           "sglang/srt/layers/attention/xpu_backend.py:37"],
        "flash_mla_decode": ["sglang/srt/layers/attention/xpu_backend.py:37"],
        "flash_mla_decode_get_workspace_size": ["sglang/srt/layers/attention/xpu_backend.py:37"],
        "flash_mla_prefill": ["sglang/srt/layers/attention/xpu_backend.py:37"],
        "flash_mla_prefill_get_workspace_size": ["sglang/srt/layers/attention/xpu_backend.py:37"],
        "gdn_attention": ["sglang/srt/hardware_backend/xpu/attention/xpu_gdn_backend.py:2"],
        "infllmv2_attn_stage1": ["sglang/srt/layers/attention/minicpm/sparse_utils.py:24"],
        "max_pooling_1d_varlen": ["sglang/srt/layers/attention/minicpm/sparse_utils.py:24"],
    },
    "sgl_kernel.mamba": {
        "causal_conv1d_fn_cpu": ["sglang/srt/layers/attention/linear/gdn_backend.py:184"],
        "causal_conv1d_update_cpu": ["sglang/srt/layers/attention/linear/gdn_backend.py:184",
                                     "sglang/srt/layers/attention/linear/kda_backend.py:39"],
        "chunk_gated_delta_rule_cpu": ["sglang/srt/layers/attention/linear/kernels/gdn_triton.py:28"],
    },
    "sgl_kernel.speculative": {
        "reconstruct_indices_from_tree_mask": ["sglang/kernels/ops/speculative/reconstruct_tree.py:50"],
    },
    "sgl_kernel.flash_attn": {
        "flash_attn_varlen_func": ["sglang/srt/layers/attention/xpu_backend.py:44",
                                   "sglang/kernels/ops/attention/flash_attention_v3.py:72 (call time)"],
        "flash_attn_with_kvcache": ["sglang/srt/layers/attention/xpu_backend.py:44",
                                    "sglang/kernels/ops/attention/flash_attention_v3.py:72 (call time)"],
    },
}

# imported inside a function body on a CPU branch (only when that function runs)
CALL_TIME = {
    "sgl_kernel": {
        "verify_tree_greedy": ["sglang/kernels/ops/speculative/spec_tree.py:495"],
        "build_draft_decode_metadata_cpu": ["sglang/srt/layers/attention/intel_amx_backend.py:438"],
    },
}

# torch.ops.sgl_kernel.NAME looked up at IMPORT time on the CPU branch (module level): must be registered.
OPS_IMPORT_TIME = {
    "fused_sigmoid_mul_cpu": ["sglang/srt/models/qwen3_5.py:284", "sglang/srt/models/muse_glimmer.py:70"],
    "fused_qk_gemma_rmsnorm_cpu": ["sglang/srt/models/qwen3_5.py:292"],
    "fused_qk_gemma_rmsnorm_with_gate_cpu": ["sglang/srt/models/qwen3_5.py:294"],
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": ["sglang/srt/models/qwen3_5.py:297"],
    "fused_gdn_gating_cpu": ["sglang/srt/layers/attention/linear/gdn_backend.py:188"],
    "fused_sigmoid_gating_delta_rule_update_cpu": ["sglang/srt/layers/attention/linear/kernels/gdn_triton.py:32"],
    "fused_moe_router_cpu": ["sglang/srt/models/grok.py:71"],
    "rmsnorm_cpu": ["sglang/srt/models/grok.py:72"],
    "fused_dual_residual_rmsnorm_cpu": ["sglang/srt/models/grok.py:73"],
    # module level but only when cpu_has_amx_support() (never true with this package, see PROBED)
    "apply_rotary_pos_emb_cpu": ["sglang/srt/layers/rotary_embedding/utils.py:144 (AMX only)"],
    "conv3d_embed_cpu": ["sglang/srt/layers/conv.py:24 (AMX only)"],
    "flash_attn_varlen_func": ["sglang/srt/layers/attention/vision.py:73 (AMX only)"],
}

# torch.ops.sgl_kernel.NAME looked up inside functions on CPU code paths (AMX-gated ones included: with this
# package cpu_has_amx_support() is False, so those are unreachable, but they fail loudly if reached).
OPS_CALL_TIME = [
    "murmur_hash32_cpu", "fused_input_proj_cpu", "decode_attention_cpu", "extend_attention_cpu",
    "weight_packed_linear", "grouped_topk_cpu", "biased_grouped_topk_cpu", "topk_softmax_cpu", "topk_sigmoid_cpu",
    "gelu_and_mul_cpu", "gelu_tanh_and_mul_cpu", "silu_and_mul_cpu", "fused_rmsnorm_gated_cpu", "l2norm_cpu",
    "fused_qk_rmsnorm_cpu", "fused_qk_rmsnorm_sumsq_cpu", "fused_qk_rmsnorm_apply_from_stats_cpu",
    "shared_expert_cpu", "bmm_cpu", "qkv_proj_with_rope_fused_weight", "int4_scaled_mm_cpu",
    "int8_scaled_mm_with_quant", "fused_experts_cpu", "fp8_scaled_mm_cpu", "fp8_per_tensor_scaled_mm_cpu",
    "convert_scale_packed", "convert_weight_packed_scale_zp", "conv3d_embed_weight_pack",
    "causal_conv1d_weight_pack", "image_preprocess_cpu", "init_cpu_threads_env", "initialize", "shm_allreduce",
    "shm_allgather", "shm_alltoall", "fused_linear_sigmoid_mul", "fused_add_rmsnorm_cpu", "layernorm_cpu",
    "gemma_fused_add_rmsnorm_cpu", "gemma_rmsnorm_cpu", "gemma3_rmsnorm_cpu", "gemma4_rmsnorm_cpu",
    "rotary_embedding_cpu", "multimodal_rotary_embedding_cpu", "apply_multidimensional_rope_cpu", "store_cache_cpu",
    "fused_qkvzba_split_reshape_cat_cpu", "fused_norm_scale_shift_cpu", "fused_scale_residual_norm_scale_shift_cpu",
    "fused_scale_shift_cpu"
]

# Deliberately NOT provided: SGLang probes for them (hasattr) or catches the ImportError and then takes its own
# torch fallback. Registering them would switch SGLang onto a kernel path that this package cannot serve.
PROBED = {
    "torch.ops.sgl_kernel.convert_weight_packed":
        "sglang/srt/utils/common.py:358 (cpu_has_amx_support -> all AMX paths)",
    "torch.ops.sgl_kernel.fused_qk_norm_cpu": "sglang/srt/models/utils.py:456",
    "torch.ops.sgl_kernel.fused_qk_norm_rope_cpu": "sglang/srt/models/qwen3_moe.py:98",
    "torch.ops.sgl_kernel.shm_group_initialize": "sglang/multimodal_gen/runtime/distributed/group_coordinator.py:232",
    "torch.ops.sgl_kernel.gdn_attention": "sglang/srt/hardware_backend/xpu/attention/xpu_gdn_backend.py:31",
    "torch.ops.sgl_kernel.get_device_accessible_ptr": "sglang/srt/mem_cache/pool_host/common.py:404",
    "torch.ops.sgl_kernel.transfer_embedding_ranges_direct": "sglang/srt/mem_cache/embedding_cache_controller.py:25",
    "sgl_kernel.rmsnorm": "sglang/srt/models/inkling_common/norm.py:8 (try/except ImportError)",
    "sgl_kernel.allreduce": "sglang/srt/distributed/device_communicators/custom_all_reduce_ops.py:21 (try)",
    "sgl_kernel.kvcacheio": "sglang/srt/mem_cache/embedding_cache_controller.py:15, pool_host/common.py:400 (try)",
    "sgl_kernel.scalar_type": "sglang/srt/layers/quantization/utils.py:27 (try); marlin (GPU) otherwise",
    "sgl_kernel.metal": "sglang/srt/hardware_backend/mlx/aot.py:18 (try)",
}

# keyword arguments SGLang passes to some ops (from tools/op_call_kwargs.py), accepted by the stub schemas
OP_KWARGS = {
    "biased_grouped_topk_cpu": ["num_token_non_padded"],
    "grouped_topk_cpu": ["num_token_non_padded"],
    "conv3d_embed_cpu": ["is_vnni"],
    "flash_attn_varlen_func": ["causal", "cu_seqlens_k", "cu_seqlens_q", "max_seqlen_k", "max_seqlen_q"],
    "topk_sigmoid_cpu": ["correction_bias", "gating_output", "hidden_states", "renormalize", "topk"],
    "topk_softmax_cpu": ["correction_bias", "gating_output", "hidden_states", "renormalize", "topk"],
    "fused_sigmoid_gating_delta_rule_update_cpu": [
        "A_log", "a", "b", "cache_steps", "cu_seqlens", "disable_state_update", "dt_bias", "initial_state_indices",
        "initial_state_source", "intermediate_state_indices", "intermediate_states_buffer", "is_kda", "k", "q",
        "retrieve_parent_token", "softplus_beta", "softplus_threshold", "use_qk_l2norm_in_kernel", "v"],
}
