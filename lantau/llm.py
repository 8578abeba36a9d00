"""The offline API in vLLM's shape: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lantau.config import EngineConfig
from lantau.engine.args import build_engine_config
from lantau.engine.core import EngineCore
from lantau.engine.llm_engine import LLMEngine
from lantau.engine.warmup import compiles_kernels, warm_up
from lantau.errors import InvalidRequestError
from lantau.model.generation_config import model_sampling_defaults, source_folder
from lantau.model.source import borrowed_vocab_size, load_tokenizer
from lantau.outputs import RequestOutput
from lantau.request import SamplingParams

__all__ = ["LLM", "Prompt", "build_engine_config"]

Prompt = str | dict  # text, or {"prompt_token_ids": [...]}


class LLM:
    """Generate offline: batches everything it is given, returns outputs in input order."""

    def __init__(self, model: str | None = None, generation_config: str = "auto", **kwargs) -> None:
        """`generation_config`: the defaults of `get_default_sampling_params` (vLLM's), the
        model's generation_config.json ("auto"), SamplingParams' own ("vllm"), or a folder's
        (lantau/model/generation_config.py)."""
        config, source = build_engine_config(model, **kwargs)
        self.sampling_defaults = model_sampling_defaults(source_folder(source), generation_config)
        self.tokenizer = load_tokenizer(source)
        fold = borrowed_vocab_size(source, config.model_config, self.tokenizer)
        core = EngineCore(config, source)
        if compiles_kernels(core):  # as the server does: no step of a run waits on a compile
            core.startup_s["warm_up"] = warm_up(core)
        self.engine = LLMEngine(core, self.tokenizer, fold)
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.engine.core.config

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix not in use (the next prompts start cold)."""
        return self.engine.core.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: SamplingParams' own
        defaults with the model's (its generation_config.json's temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens) over them."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = (
            sampling_params if sampling_params is not None else self.get_default_sampling_params()
        )
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params", "must be one or one per prompt")
        priority = list(priority) if priority is not None else [0] * len(prompts)
        for prompt, p in zip(prompts, params, strict=True):  # all first: a bad one queues nothing
            self.engine.core.validate(self.engine.tokenize(prompt)[1], p)
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
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`, else the model's) to one conversation or
        a list of them (with OpenAI-shaped `tools`, as HF templates take them)."""
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not template:
            raise InvalidRequestError("messages", "this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.encode_chat(conv, add_generation_prompt, tools, template)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def encode_chat(
        self,
        conversation: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )  # fmt: skip
        return self.tokenizer.encode(text, add_special_tokens=False)
