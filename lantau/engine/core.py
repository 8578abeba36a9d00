"""The engine core: owns the device, the scheduler and the runner; one step at a time.

step():  Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update()
"""

from __future__ import annotations

import logging

import torch

from lantau.config import EngineConfig
from lantau.errors import InvalidRequestError
from lantau.kv_cache.manager import KVCacheManager, cdiv
from lantau.model.loader import ModelSource, build_model
from lantau.request import FinishReason, Request
from lantau.runner.model_runner import ModelRunner, kv_cache_bytes_per_block
from lantau.scheduler.output import EngineCoreOutput
from lantau.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Room left on the card for activations, logits and the allocator's slack, beyond weights.
CUDA_ACTIVATION_RESERVE_BYTES = 4 << 30


def num_kv_blocks(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """KV blocks that fit the memory budget left once the weights are loaded."""
    per_block = kv_cache_bytes_per_block(config, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.cache.gpu_memory_utilization) - (total - free)
        budget -= CUDA_ACTIVATION_RESERVE_BYTES
    else:
        budget = config.cache.cpu_kv_cache_bytes
    return max(budget // per_block, 0)


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        model = build_model(source, config.model_config, dtype, self.device, config.seed)
        num_blocks = config.cache.num_blocks or num_kv_blocks(config, dtype, self.device)
        needed = cdiv(config.scheduler.max_model_len, config.cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks, fewer than the {needed} one request of "
                f"max_model_len={config.scheduler.max_model_len} may need; lower max_model_len "
                "or give the cache more memory"
            )
        self.config = config.with_num_blocks(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, config.cache.block_size)
        self.kv_cache = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.runner = ModelRunner(self.config, model, num_blocks, self.device)

    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raise InvalidRequestError for a prompt the engine cannot serve."""
        max_len = self.config.scheduler.max_model_len
        vocab = self.config.model_config.vocab_size
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "is empty")
        if len(prompt_token_ids) >= max_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids)} tokens leave no room for output within "
                f"max_model_len={max_len}",
            )
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError("prompt_token_ids", f"must be integers in [0, {vocab})")

    def add_request(self, request: Request) -> None:
        self.validate(request.prompt_token_ids)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        request.max_model_len = self.config.scheduler.max_model_len
        self.scheduler.add_request(request)

    def abort_requests(
        self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self.scheduler.finish_requests(request_ids, reason)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        return self.scheduler.update(out, result)
