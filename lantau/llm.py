"""The offline API in vLLM's shape: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lantau import envs
from lantau.config import CacheConfig, EngineConfig, KernelConfig, SchedulerConfig
from lantau.engine.core import EngineCore
from lantau.engine.llm_engine import LLMEngine
from lantau.errors import InvalidRequestError
from lantau.model.loader import load_tokenizer, read_model_config, resolve_model_source
from lantau.outputs import RequestOutput
from lantau.request import SamplingParams

Prompt = str | dict  # text, or {"prompt_token_ids": [...]}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype, device: str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype: {dtype!r} is not one of auto, float32, float16, bfloat16")
    return dtype


def build_engine_config(
    model: str | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    gpu_memory_utilization: float = 0.90,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "max_utilization",
    attention_backend: str = "auto",
    enforce_eager: bool = False,
    async_scheduling: bool = True,
    kernels: KernelConfig | None = None,
):
    """The frozen EngineConfig and the model source, from user-facing arguments. `kernels`:
    the triton backend's choices (default: KernelConfig's, PDL as LANTAU_PDL says)."""
    if tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: only 1 is supported so far")
    source = resolve_model_source(model)
    model_config = read_model_config(source)
    max_len = min(max_model_len or model_config.max_position_embeddings, 1 << 20)
    if max_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len: {max_len} exceeds the model's "
            f"{model_config.max_position_embeddings} positions"
        )
    device = resolve_device(device)
    if attention_backend == "auto":
        attention_backend = "triton" if device.startswith("cuda") else "torch"
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 4096 if enable_chunked_prefill else max_len
    config = EngineConfig(
        model=source.name,
        model_config=model_config,
        dtype=resolve_dtype(dtype, device),
        device=device,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        attention_backend=attention_backend,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
        kernels=kernels or KernelConfig(enable_pdl=envs.pdl_enabled()),
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_model_len=max_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=scheduling_policy,
        ),
    )
    return config, source


class LLM:
    """Generate offline: batches everything it is given, returns outputs in input order."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        config, source = build_engine_config(model, **kwargs)
        self.tokenizer = load_tokenizer(source)
        self.engine = LLMEngine(EngineCore(config, source), self.tokenizer)
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.engine.core.config

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix not in use (the next prompts start cold)."""
        return self.engine.core.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params", "must be one or one per prompt")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        for prompt in prompts:  # validate all first: a bad prompt queues nothing
            self.engine.core.validate(self.engine.tokenize(prompt)[1])
        request_ids = [str(next(self._ids)) for _ in prompts]
        for request_id, prompt, p, prio in zip(request_ids, prompts, params, priority, strict=True):
            self.engine.add_request(request_id, prompt, p, prio)
        return self._run(request_ids)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests:
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        except BaseException:
            for request_id in request_ids:  # leave no request (and no KV block) behind
                self.engine.abort_request(request_id)
            raise
        return [finished[r] for r in request_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.encode_chat(conv, add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def encode_chat(self, conversation: list[dict], add_generation_prompt: bool = True):
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode(text, add_special_tokens=False)
