"""vLLM's configuration names over EngineConfig: the read-only views and EngineArgs."""

from __future__ import annotations

import dataclasses

import pytest

from legato import AsyncEngineArgs, EngineArgs, EngineConfig, VllmConfig


def test_engine_args_map_vllms_names_onto_engine_config() -> None:
    args = EngineArgs(
        model="/models/m",
        served_model_name=["m"],
        num_gpu_blocks_override=64,
        kv_cache_memory_bytes=2**20,
        max_num_seqs=8,
        scheduling_policy="priority",
        enable_lora=True,
        legato_options={"executor": "inproc"},
    )
    config = args.to_engine_config()
    assert (config.model, config.served_model_name) == ("/models/m", "m")
    assert (config.num_kv_blocks, config.kv_cache_memory) == (64, 2**20)
    assert (config.max_num_seqs, config.scheduling_policy) == (8, "priority")
    assert config.enable_lora and config.executor == "inproc"
    view = args.create_engine_config()
    assert view.cache_config.num_gpu_blocks_override == 64
    assert view.scheduler_config.policy == "priority"


def test_unsupported_vllm_fields_are_refused_by_name_unless_at_the_default() -> None:
    EngineArgs(pipeline_parallel_size=1, trust_remote_code=False, swap_space=4)  # defaults
    for name, value in [
        ("pipeline_parallel_size", 2),
        ("data_parallel_size", 2),
        ("quantization", "awq"),
        ("trust_remote_code", True),
        ("enable_prompt_embeds", True),  # vLLM's switch for embeds prompts: refused by name
    ]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            EngineArgs(**{name: value})
    with pytest.raises(ValueError, match="served_model_name: legato serves one name"):
        EngineArgs(served_model_name=["a", "b"])
    with pytest.raises(ValueError, match="enable_log_requests"):
        AsyncEngineArgs(enable_log_requests=True)
    with pytest.raises(TypeError, match="no_such_flag"):
        EngineArgs(no_such_flag=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="no_such_option"):
        EngineArgs(legato_options={"no_such_option": 1}).to_engine_config()
    with pytest.raises(ValueError, match="max_num_seqs"):  # EngineConfig's own checks
        EngineArgs(max_num_seqs=0).to_engine_config()


def test_vllm_config_is_a_read_only_view_under_vllms_names() -> None:
    config = EngineConfig(
        model="/models/m", max_model_len=512, num_kv_blocks=40, tensor_parallel_size=2
    )
    view = VllmConfig.of(config, dtype="bfloat16")
    assert view.engine_config is config
    model = view.model_config
    assert (model.model, model.tokenizer, model.served_model_name) == ("/models/m",) * 3
    assert (model.max_model_len, model.dtype, model.max_logprobs) == (512, "bfloat16", 20)
    assert view.cache_config.num_gpu_blocks == 40
    assert view.scheduler_config.chunked_prefill_enabled
    assert view.parallel_config.world_size == 2
    assert view.lora_config is None  # None unless enable_lora, as vLLM's
    assert view.structured_outputs_config is view.decoding_config
    assert view.observability_config.log_stats
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.max_model_len = 4  # type: ignore[misc]
    assert VllmConfig.of(config).model_config.dtype == "auto"  # not loaded yet
