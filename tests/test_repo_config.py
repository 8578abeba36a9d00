"""config.pbtxt: Triton's text format through Triton's ModelConfig message, mapped onto
lantau's scheduler; the reference deployment's file loads as is, and every bad field is named."""

from __future__ import annotations

import pytest

from lantau.server.repo_config import ModelConfigError, VersionPolicy, parse_config_text

# the reference deployment's file (docs/model-repository.md), as Triton + TensorRT-LLM ran it
REFERENCE = """
name: "llama"
backend: "tensorrtllm"
max_batch_size: 32
instance_group [{ count: 2, kind: KIND_GPU, gpus: [0, 1] }]
dynamic_batching { preferred_batch_size: [8, 16, 32], max_queue_delay_microseconds: 100 }
model_transaction_policy { decoupled: True }
"""


def parse(text: str):
    return parse_config_text(text, "llama/config.pbtxt", "llama")


def test_the_reference_file_loads_as_is():
    config = parse(REFERENCE)
    assert config.max_num_seqs == 32  # max_batch_size -> sequences in flight
    assert config.num_replicas == 4  # count 2 on each of 2 GPUs, as Triton counts them
    assert config.device == "auto"
    assert config.ignored == ("backend",)
    assert config.version_policy == VersionPolicy("latest", 1)


def test_every_mapped_field():
    config = parse(
        """
        name: "llama"
        version_policy { specific { versions: [1, 3] } }
        instance_group [{ count: 1, kind: KIND_CPU }]
        dynamic_batching {
          priority_levels: 3
          default_priority_level: 2
          default_queue_policy { max_queue_size: 64 }
        }
        parameters { key: "max_model_len" value: { string_value: "256" } }
        parameters { key: "gpu_memory_utilization" value: { string_value: "0.45" } }
        parameters { key: "enable_prefix_caching" value: { string_value: "false" } }
        parameters { key: "swap" value: { string_value: "drain_first" } }
        parameters { key: "canary_share" value: { string_value: "0.25" } }
        """
    )
    assert config.device == "cpu" and config.max_pending_requests == 64
    assert config.default_priority == 2 and config.engine_args == {
        "max_model_len": 256, "gpu_memory_utilization": 0.45, "enable_prefix_caching": False,
    }  # fmt: skip
    assert config.swap == "drain_first" and config.canary.share == 0.25
    assert config.version_policy.select([1, 2, 3, 4]) == [3, 1]
    assert parse("version_policy { all {} }").version_policy.select([2, 1]) == [2, 1]
    assert parse("version_policy { latest { num_versions: 2 } }").version_policy.select(
        [1, 2, 3]
    ) == [3, 2]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("max_batch_sizes: 4", "has no field named \"max_batch_sizes\""),
        ("max_batch_size: -1", "max_batch_size: must be >= 0"),
        ("max_batch_size: \"x\"", "line 1: "),
        ('name: "other"', "name: 'other' differs from its folder"),
        ("sequence_batching {}", "sequence_batching: not supported"),
        ("max_batch_size: 8 dynamic_batching { preferred_batch_size: [16] }",
         "dynamic_batching.preferred_batch_size: 16 is not within"),
        ("instance_group [{ kind: KIND_MODEL }]", "instance_group[0].kind"),
        ("instance_group [{ count: 1, rate_limiter {} }]", "instance_group[0].rate_limiter"),
        ('parameters { key: "gpt_model_path" value: { string_value: "x" } }',
         "parameters['gpt_model_path']: unknown parameter"),
        ('parameters { key: "canary_share" value: { string_value: "2" } }',
         "parameters['canary_share']: '2': must be within 0..1"),
        ("version_policy { latest { num_versions: 0 } }", "version_policy.latest.num_versions"),
        ('parameters { key: "gpu_memory_utilization" value: { string_value: "0" } }',
         "parameters['gpu_memory_utilization']: '0': must be within (0, 1]"),
        ('parameters { key: "lora_modules" value: { string_value: "brand" } }',
         "parameters['lora_modules']: 'brand': lora module 'brand': expected NAME=PATH"),
        ('parameters { key: "lora_modules" value: { string_value: "a=x,a=y" } }',
         "lora module 'a': given twice"),
        ('parameters { key: "lora_modules" value: { string_value: "a=loras/a" } }',
         "a: llama/loras/a is not a PEFT adapter folder"),
        ('parameters { key: "max_loras" value: { string_value: "-1" } }',
         "parameters['max_loras']: '-1': must be >= 0"),
    ],
)  # fmt: skip
def test_bad_fields_are_named(text, field):
    with pytest.raises(ModelConfigError, match="llama/config.pbtxt: ") as e:
        parse(text)
    assert field in str(e.value)


def test_canary_verdicts():
    from lantau.server.model_control import Window, judge_canary
    from lantau.server.repo_config import CanaryPolicy

    policy = CanaryPolicy(share=0.5, num_requests=4, p95_ratio=2.0, max_error_rate=0.25)
    fast, slow = Window([0.1, 0.1, 0.12, 0.1]), Window([0.3, 0.31, 0.29, 0.3])
    assert judge_canary(Window([0.1, 0.15, 0.1, 0.12]), fast, policy) is None
    assert "P95 310 ms > 2 x the previous version's 120 ms" in judge_canary(slow, fast, policy)
    assert "error rate 50%" in judge_canary(Window([0.1, 0.1], num_errors=2), fast, policy)


def test_serve_flags(tmp_path):
    """`lantau serve REPO` is a repository; the control flags need one and agree."""
    import argparse

    from lantau.cli import _repository_options

    (tmp_path / "llama" / "1").mkdir(parents=True)

    def options(model=None, repo=None, mode=None, load=None):
        return _repository_options(argparse.Namespace(
            model=model, model_repository=repo, model_control_mode=mode, load_model=load,
            repository_poll_secs=15.0,
        ))  # fmt: skip

    assert options(model=str(tmp_path)).control_mode == "none"
    explicit = options(repo=str(tmp_path), mode="explicit", load=["llama"])
    assert explicit.load_models == ("llama",)
    assert "needs --model-control-mode explicit" in options(repo=str(tmp_path), load=["llama"])
    assert "need --model-repository" in options(model="random:tiny", mode="poll")
    assert "no such folder" in options(repo=str(tmp_path / "nope"))


def test_canary_window_ends_on_time():
    """A canary phase without traffic is judged when canary_window_s passes (no verdict
    against it: promoted)."""
    import asyncio

    from lantau.server.model_control import ModelManager, RepoModel, VersionEngine
    from lantau.server.repo_config import CanaryPolicy, RepoModelConfig

    class Manager(ModelManager):
        def __init__(self) -> None:  # no repository, no engines: the judging alone
            import collections

            self.transitions = collections.Counter()

    async def run() -> RepoModel:
        model = RepoModel("m")
        old, new = VersionEngine(1, object()), VersionEngine(2, object())
        model.loaded = {1: old, 2: new}
        model.set_primary(old)
        config = RepoModelConfig("m", canary=CanaryPolicy(share=0.5, window_s=0.05))
        manager = Manager()
        manager._begin_canary(model, config, new, to_stop=[])
        await model.canary_task
        return model, manager

    model, manager = asyncio.run(run())
    assert model.primary.version == 2 and model.canary is None and model.busy is None
    assert manager.transitions[("m", "promote", "1", "2")] == 1
